"""Crash-consistent sharded checkpoints that any world size can load.

Layout under the checkpoint folder::

    step_00000006/           a committed checkpoint (the name appears only once it is whole)
      rank0.pt ... rankN.pt  one file per rank of the world that saved it
      COMMIT.json            step, world size, each file's bytes + sha256 + optimizer range,
                             and the caller's metadata (config, profile fingerprint, loader)
    step_00000008.tmp/       being written (or torn by a crash: ignored, removed on next save)

Saving (`save`, every rank together): rank 0 clears a stale temporary folder; each rank
writes ``rankR.pt.part``, fsyncs and renames it to ``rankR.pt``; the ranks' (bytes, sha256)
reach rank 0 in one gather; rank 0 writes ``COMMIT.json`` (temp + rename), renames the folder
to its final name (the commit) and only then deletes checkpoints older than the ``keep``
newest (and folders of later steps: torn leftovers of the attempt the run resumed from); a
barrier ends the save. A crash at any point leaves the previous checkpoint intact.

Loading (`latest`, every rank together): each rank lists the committed folders newest first
and checks each (marker readable, every file present with its recorded size, the files this
rank will read match their sha256, each file's own step and rank match); the ranks gather
which steps they found valid and take the newest valid on *every* rank, so all ranks resume
from the same step. Torn, partial or mixed folders are skipped with a warning naming why.
Files are read with ``torch.load(weights_only=True)``: tensors and plain containers only.

Two layouts share this protocol (the marker's ``version``):

- version 1, per-rank files (``save``): ``rankR.pt`` holds rank R's payload (rank 0 also the
  model); the optimizer state is ZeRO-1 ranges of the flat parameter vector. Written by
  runs with shard_size 1.
- version 2, `torch.distributed.checkpoint` (``save_dcp``): the tensors keyed by parameter
  name (`dcparallel.runtime.sharded_checkpoint`: DCP's ``.metadata`` and one ``__R_0.distcp``
  per rank) plus ``rngR.pt`` per rank; the marker also lists every file's bytes + sha256 and
  the shard size. Written by runs with shard_size > 1. When such a checkpoint is verified,
  the ranks split the sha256 checks of its files between them (file i on rank i mod W), and
  `latest` takes a step only if every rank found its share whole.

Both load at any world size and shard size (`dcparallel.apps.train_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dcparallel.runtime import comm

log = logging.getLogger(__name__)

MARKER = "COMMIT.json"
SCHEMA = "dcparallel.checkpoint"
VERSION = 1  # per-rank files
VERSION_DCP = 2  # torch.distributed.checkpoint


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its folder, step, world size and marker contents."""

    path: Path
    step: int
    world_size: int
    marker: dict

    @property
    def meta(self) -> dict:
        return self.marker["meta"]

    @property
    def version(self) -> int:
        return int(self.marker["version"])

    @property
    def shard_size(self) -> int:
        return int(self.marker.get("shard_size", 1))

    def load_rng(self, rank: int) -> dict:
        """Rank ``rank``'s RNG states (`rng_state`) as saved."""
        if self.version == VERSION:
            return self.load(rank)["rng"]
        return torch.load(self.path / f"rng{rank}.pt", map_location="cpu", weights_only=True)

    def load(self, rank: int) -> dict:
        """Rank ``rank``'s file of this checkpoint (tensors and containers only)."""
        return torch.load(self.path / f"rank{rank}.pt", map_location="cpu", weights_only=True)

    def ranks_overlapping(self, start: int, stop: int) -> list[int]:
        """The saved ranks whose optimizer range overlaps ``[start, stop)``."""
        return [
            int(r)
            for r, f in sorted(self.marker["files"].items(), key=lambda kv: int(kv[0]))
            if max(start, f["start"]) < min(stop, f["stop"])
        ]


def committed_steps(root: str | Path) -> list[int]:
    """Steps of the folders that look committed (not yet verified), newest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for p in r.iterdir():
        if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit():
            out.append(int(p.name[5:]))
    return sorted(out, reverse=True)


def verify(
    root: str | Path, step: int, read_ranks: list[int] | None = None, *, hash_files: bool = True
) -> tuple[Committed | None, str]:
    """(the checkpoint, "") if the folder of ``step`` is whole, else (None, why not). Version 1:
    files in ``read_ranks`` (default all) are also checked against their sha256; version 2:
    this rank's share of the files (file i on rank i mod W). ``hash_files`` False: sizes only."""
    d = _step_dir(Path(root), step)
    try:
        marker = json.loads((d / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{d}: no readable commit marker ({exc.__class__.__name__}: {exc})"
    if (
        marker.get("schema") != SCHEMA
        or marker.get("version") not in (VERSION, VERSION_DCP)
        or marker.get("step") != step
    ):
        return None, f"{d}: the commit marker is not a version-{VERSION} or -{VERSION_DCP} marker of step {step}"
    world = int(marker["world_size"])
    files = marker.get("files", {})
    if marker["version"] == VERSION_DCP:
        names = sorted(files)
        for name in names:
            p = d / name
            if not p.exists():
                return None, f"{d}: {name} is missing"
            if p.stat().st_size != files[name]["bytes"]:
                return None, (
                    f"{d}: {name} has {p.stat().st_size} bytes, {files[name]['bytes']} were committed (torn write?)"
                )
        rank, now = comm.world_rank(), comm.world_size()
        for name in names[rank::now] if hash_files else []:
            if _sha256(d / name) != files[name]["sha256"]:
                return None, f"{d}: {name} does not match its committed sha256 (overwritten or corrupt)"
        return Committed(d, step, world, marker), ""
    if sorted(int(r) for r in files) != list(range(world)):
        return None, f"{d}: the marker lists ranks {sorted(files)} for a world of {world}"
    for r, f in files.items():
        p = d / f"rank{r}.pt"
        if not p.exists():
            return None, f"{d}: {p.name} is missing"
        size = p.stat().st_size
        if size != f["bytes"]:
            return None, f"{d}: {p.name} has {size} bytes, {f['bytes']} were committed (torn write?)"
    for r in (range(world) if read_ranks is None else read_ranks) if hash_files else []:
        if r < world and _sha256(d / f"rank{r}.pt") != files[str(r)]["sha256"]:
            return None, f"{d}: rank{r}.pt does not match its committed sha256 (overwritten or corrupt)"
    return Committed(d, step, world, marker), ""


def latest(root: str | Path, reads: Any = None) -> Committed | None:
    """The newest checkpoint that is whole on every rank (collective: call on every rank
    together), or None when there is none at all. ``reads(marker) -> ranks`` says which
    files this rank will read (checked against their sha256; default: all).

    Raises ValueError if committed folders exist but none is valid on every rank."""
    valid, why = [], []
    for step in committed_steps(root):  # at most `keep` of them, plus stale ones
        read_ranks = None
        if reads is not None:
            try:
                marker = json.loads((_step_dir(Path(root), step) / MARKER).read_text())
                read_ranks = list(reads(marker)) if marker.get("version") == VERSION else None
            except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
                read_ranks = None  # verify() reports the unreadable marker
        ck, reason = verify(root, step, read_ranks)
        (valid.append(step) if ck is not None else why.append(reason))
    everyone = comm.all_gather_object((valid, why))
    reasons = sorted({w for _, ws in everyone for w in ws})
    if comm.world_rank() == 0:
        for w in reasons:
            log.warning("skipping checkpoint: %s", w)
    steps_by_rank = [set(v) for v, _ in everyone]
    common = set.intersection(*steps_by_rank)
    if len({max(s, default=None) for s in steps_by_rank}) > 1 and comm.world_rank() == 0:
        log.warning(
            "ranks see different newest checkpoints %s; using the newest one every rank can read",
            [max(s, default=None) for s in steps_by_rank],
        )
    if common:
        return verify(root, max(common), hash_files=False)[0]
    if not reasons and not any(steps_by_rank):
        return None
    seen = "; ".join(reasons) or f"the ranks see steps {[sorted(s) for s in steps_by_rank]}"
    raise ValueError(
        f"the checkpoint folder {root} holds no checkpoint every rank can read: {seen}. "
        f"Delete the broken folders (or the whole folder to start over)"
    )


def _refuse_sharded(payload: Mapping[str, Any]) -> None:
    """This format holds replicated parameters (saved by rank 0) and ZeRO-1 ranges of one flat
    vector: parameters sharded in blocks (DTensors, shard_size > 1) or a ShardedAdamW state
    would be saved incomplete, so they are refused."""
    from torch.distributed.tensor import DTensor

    def walk(x: Any) -> bool:
        if isinstance(x, DTensor):
            return True
        if isinstance(x, Mapping):
            shard = x.get("shard")
            return (isinstance(shard, Mapping) and "shard_size" in shard) or any(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return any(walk(v) for v in x)
        return False

    if walk(payload):
        raise ValueError(
            "this checkpoint holds parameter-sharded state (shard_size > 1: FSDP DTensors or a "
            "ShardedAdamW state), which the per-rank format (version 1) would save incomplete; save "
            "a sharded run with checkpoint.save_dcp and runtime.sharded_checkpoint.save (dcparallel "
            "train does)"
        )


def _begin(root: Path, step: int) -> Path:
    """The empty temporary folder of ``step`` (collective; rank 0 clears a stale one)."""
    tmp = _step_dir(root, step).with_name(f"step_{step:08d}.tmp")
    if comm.world_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    comm.barrier()
    return tmp


def _publish(root: Path, step: int, tmp: Path, marker: dict, keep: int) -> Path:
    """Rank 0: writes the marker, renames the folder (the commit), then drops later and
    older folders; a barrier on every rank ends the save."""
    final = _step_dir(root, step)
    if comm.world_rank() == 0:
        _write_atomic(tmp / MARKER, lambda f: f.write(json.dumps(marker, indent=1).encode()))
        _fsync_dir(tmp)
        if final.exists():  # a stale copy of the same step (a replayed step): replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        # folders of later steps are torn leftovers (the run resumed from an earlier step)
        for later in [s for s in committed_steps(root) if s > step]:
            shutil.rmtree(_step_dir(root, later), ignore_errors=True)
        for old in committed_steps(root)[keep:]:
            shutil.rmtree(_step_dir(root, old), ignore_errors=True)
    comm.barrier()
    return final


def save(
    root: str | Path,
    step: int,
    payload: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    optimizer_range: tuple[int, int],
    keep: int = 2,
) -> Path:
    """Writes this rank's ``payload`` as part of the checkpoint of ``step`` (collective;
    version 1). ``optimizer_range``: the flat range [start, stop) of the optimizer shard in
    the payload. ``meta`` (JSON-serializable) goes into the commit marker. Keeps the ``keep``
    newest."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1; got {keep}")
    _refuse_sharded(payload)
    r = Path(root)
    rank, world = comm.world_rank(), comm.world_size()
    tmp = _begin(r, step)
    path = tmp / f"rank{rank}.pt"
    _write_atomic(path, lambda f: torch.save(dict(payload), f))
    info = {
        "bytes": path.stat().st_size,
        "sha256": _sha256(path),
        "start": optimizer_range[0],
        "stop": optimizer_range[1],
    }
    infos = comm.all_gather_object(info)
    if rank == 0:
        missing = [i for i in range(world) if not (tmp / f"rank{i}.pt").exists()]
        if missing:
            raise RuntimeError(
                f"checkpoint of step {step}: ranks {missing} wrote no file into {tmp}; is {r} a "
                f"folder every rank shares?"
            )
    marker = {
        "schema": SCHEMA,
        "version": VERSION,
        "step": step,
        "world_size": world,
        "files": {str(i): x for i, x in enumerate(infos)},
        "meta": dict(meta),
    }
    return _publish(r, step, tmp, marker, keep)


def save_dcp(
    root: str | Path,
    step: int,
    write: Callable[[Path], None],
    meta: Mapping[str, Any],
    *,
    shard_size: int,
    keep: int = 2,
) -> Path:
    """Writes the checkpoint of ``step`` in version 2 (collective): ``write(folder)`` saves
    the tensors through `torch.distributed.checkpoint` (every rank), each rank adds its RNG
    states (``rngR.pt``), then the marker lists every file with its bytes and sha256 (each
    rank hashes its own). Keeps the ``keep`` newest."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1; got {keep}")
    r = Path(root)
    rank, world = comm.world_rank(), comm.world_size()
    tmp = _begin(r, step)
    write(tmp)
    _write_atomic(tmp / f"rng{rank}.pt", lambda f: torch.save(rng_state(), f))
    mine = [
        p
        for p in tmp.iterdir()
        if p.name == f"rng{rank}.pt" or p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == ".metadata")
    ]
    infos = comm.all_gather_object({p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in mine})
    files = {k: v for x in infos for k, v in x.items()}
    if rank == 0 and ".metadata" not in files:
        raise RuntimeError(f"checkpoint of step {step}: torch.distributed.checkpoint wrote no .metadata into {tmp}")
    marker = {
        "schema": SCHEMA,
        "version": VERSION_DCP,
        "step": step,
        "world_size": world,
        "shard_size": shard_size,
        "files": files,
        "meta": dict(meta),
    }
    return _publish(r, step, tmp, marker, keep)


# ---------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU and CUDA, Python, NumPy) as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
