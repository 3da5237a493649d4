"""A copy of the writer of dcparallel 0.1's per-rank checkpoints (marker version 1), kept so
tests can make the old folders that `dcparallel.checkpoint` refuses and
`dcparallel.apps.checkpoint_convert` converts. Collective like the original (every rank
writes its ``rankR.pt``; rank 0 the marker, then the rename that commits); one process
writes a world-1 folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dcparallel.runtime import comm


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_per_rank(
    root: str | Path, step: int, payload: dict[str, Any], meta: dict, *, optimizer_range: tuple[int, int]
) -> Path:
    """This rank's ``payload`` (``optimizer``: `ZeroAdamW.state_dict`, ``rng``, rank 0's
    ``model``) as its file of the version-1 checkpoint of ``step`` under ``root``."""
    root = Path(root)
    rank, world = comm.world_rank(), comm.world_size()
    tmp, final = root / f"step_{step:08d}.tmp", root / f"step_{step:08d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    comm.barrier()
    path = tmp / f"rank{rank}.pt"
    torch.save(dict(payload), path)
    info = {"bytes": path.stat().st_size, "sha256": _sha256(path), "start": optimizer_range[0]}
    infos = comm.all_gather_object({**info, "stop": optimizer_range[1]})
    if rank == 0:
        marker = {
            "schema": "dcparallel.checkpoint",
            "version": 1,
            "step": step,
            "world_size": world,
            "files": {str(i): x for i, x in enumerate(infos)},
            "meta": dict(meta),
        }
        (tmp / "COMMIT.json").write_text(json.dumps(marker, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    comm.barrier()
    return final
