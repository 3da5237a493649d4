"""Crash-consistent checkpoints that any world size and shard size can load.

Layout under the checkpoint folder::

    step_00000006/           a committed checkpoint (the name appears only once it is whole)
      .metadata              torch.distributed.checkpoint's index of the tensors
      __0_0.distcp ...       one data file per rank of the world that saved it
      rng0.pt ... rngN.pt    each rank's RNG states
      COMMIT.json            step, world size, shard size, every file's bytes + sha256, and the
                             caller's metadata (config, profile fingerprint, loader)
    step_00000008.tmp/       being written (or torn by a crash: ignored, removed on next save)

The tensors are written by `torch.distributed.checkpoint`, keyed by parameter name
(`dcparallel.runtime.sharded_checkpoint`: each rank writes the pieces its optimizer owns), for
every shard size including 1; one format (``version`` 2 of the marker) is written.

Saving (`save`, every rank together): rank 0 clears a stale temporary folder; the caller's
``write(folder)`` writes the tensors, each rank its ``rngR.pt`` (fsynced, renamed into place);
the ranks' (bytes, sha256) of their own files reach rank 0 in one gather; rank 0 writes
``COMMIT.json`` (temp + rename), renames the folder to its final name (the commit) and only
then deletes checkpoints older than the ``keep`` newest (and folders of later steps: torn
leftovers of the attempt the run resumed from); a barrier ends the save. A crash at any point
leaves the previous checkpoint intact.

Loading (`latest`, every rank together): each rank lists the committed folders newest first
and checks each (marker readable, every file present with its recorded size, its share of
the files against their sha256: file i on rank i mod W); the ranks gather which steps they
found valid and take the newest valid on *every* rank, so all ranks resume from the same
step. Torn, partial or mixed folders are skipped with a warning naming why. The RNG files
are read with ``torch.load(weights_only=True)``: tensors and plain containers only.

A folder in the per-rank format of dcparallel 0.1 (``version`` 1: ``rankR.pt`` files) is not
loaded: `verify` refuses it with the command that converts it in place
(`dcparallel.apps.checkpoint_convert`, kept for one release).
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
VERSION = 2  # torch.distributed.checkpoint, every shard size
VERSION_DCP = VERSION  # the name tests and tools also use
VERSION_PER_RANK = 1  # dcparallel 0.1's per-rank files: refused, converted by apps.checkpoint_convert

CONVERT_HINT = (
    "convert it once, in place, in one process: dcparallel convert-checkpoint --config <the "
    "run's config> (or dcparallel.apps.checkpoint_convert.convert(root, model))"
)


def step_dir(root: Path, step: int) -> Path:
    """The folder of the committed checkpoint of ``step`` under ``root``."""
    return root / f"step_{step:08d}"


def sha256(path: Path) -> str:
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


def write_atomic(path: Path, write: Callable[[Any], Any]) -> None:
    """``write(f)`` into ``path.part``, fsynced, then renamed to ``path``."""
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
        """Rank ``rank``'s RNG states (`rng_state`) as saved (tensors and containers only)."""
        return torch.load(self.path / f"rng{rank}.pt", map_location="cpu", weights_only=True)


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


def read_marker(folder: Path, step: int) -> tuple[dict | None, str]:
    """(the commit marker of the step folder ``folder``, "") or (None, why it is unreadable or
    not a marker of ``step``)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{folder}: no readable commit marker ({exc.__class__.__name__}: {exc})"
    if marker.get("schema") != SCHEMA or marker.get("step") != step or not isinstance(marker.get("version"), int):
        return None, f"{folder}: the commit marker is not a dcparallel checkpoint marker of step {step}"
    return marker, ""


def verify(root: str | Path, step: int, *, hash_files: bool = True) -> tuple[Committed | None, str]:
    """(the checkpoint, "") if the folder of ``step`` is whole, else (None, why not): every
    file present with its committed size and this rank's share of them (file i on rank i mod
    W) matching its sha256 (``hash_files`` False: sizes only). A per-rank (version 1) folder
    is refused with the command that converts it."""
    d = step_dir(Path(root), step)
    marker, why = read_marker(d, step)
    if marker is None:
        return None, why
    if marker["version"] == VERSION_PER_RANK:
        return (
            None,
            f"{d} is in the per-rank checkpoint format of dcparallel 0.1, which is no longer read; {CONVERT_HINT}",
        )
    if marker["version"] != VERSION:
        return None, f"{d}: the commit marker is of version {marker['version']}, this dcparallel reads {VERSION}"
    files = marker.get("files", {})
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
        if sha256(d / name) != files[name]["sha256"]:
            return None, f"{d}: {name} does not match its committed sha256 (overwritten or corrupt)"
    return Committed(d, step, int(marker["world_size"]), marker), ""


def latest(root: str | Path) -> Committed | None:
    """The newest checkpoint that is whole on every rank (collective: call on every rank
    together), or None when there is none at all.

    Raises ValueError if committed folders exist but none is valid on every rank."""
    valid, why = [], []
    for step in committed_steps(root):  # at most `keep` of them, plus stale ones
        ck, reason = verify(root, step)
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
    fix = "Delete the broken folders (or the whole folder to start over)"
    if reasons and all(CONVERT_HINT in w for w in reasons):  # old folders only: converted, not deleted
        fix = "Do not delete them: convert them as said"
    raise ValueError(f"the checkpoint folder {root} holds no checkpoint every rank can read: {seen}. {fix}")


def _begin(root: Path, step: int) -> Path:
    """The empty temporary folder of ``step`` (collective; rank 0 clears a stale one)."""
    tmp = step_dir(root, step).with_name(f"step_{step:08d}.tmp")
    if comm.world_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    comm.barrier()
    return tmp


def _publish(root: Path, step: int, tmp: Path, marker: dict, keep: int | None) -> Path:
    """Rank 0: writes the marker, renames the folder (the commit), then drops later and
    older folders (``keep`` None: none); a barrier on every rank ends the save."""
    final = step_dir(root, step)
    if comm.world_rank() == 0:
        write_atomic(tmp / MARKER, lambda f: f.write(json.dumps(marker, indent=1).encode()))
        _fsync_dir(tmp)
        if final.exists():  # a stale copy of the same step (a replayed step): replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        # folders of later steps are torn leftovers (the run resumed from an earlier step)
        for later in [s for s in committed_steps(root) if s > step] if keep is not None else []:
            shutil.rmtree(step_dir(root, later), ignore_errors=True)
        for old in committed_steps(root)[keep:] if keep is not None else []:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)
    comm.barrier()
    return final


def _owned(tmp: Path, rank: int, world: int) -> list[Path]:
    """The files of ``tmp`` rank ``rank`` wrote (in a one-process world: all of them)."""
    return [
        p
        for p in tmp.iterdir()
        if world == 1
        or p.name == f"rng{rank}.pt"
        or p.name.startswith(f"__{rank}_")
        or (rank == 0 and p.name == ".metadata")
    ]


def save(
    root: str | Path,
    step: int,
    write: Callable[[Path], None],
    meta: Mapping[str, Any],
    *,
    shard_size: int,
    keep: int | None = 2,
    saved_world: int | None = None,
) -> Path:
    """Writes the checkpoint of ``step`` (collective): ``write(folder)`` saves the tensors
    through `torch.distributed.checkpoint` (every rank), each rank adds its RNG states
    (``rngR.pt``), then the marker lists every file with its bytes and sha256 (each rank
    hashes its own). ``meta`` (JSON-serializable) goes into the marker. Keeps the ``keep``
    newest (None: removes no other folder). ``saved_world``: the world size the marker
    records when one process writes a whole checkpoint of a larger world (``write`` then
    writes every rank's RNG file too: the conversion of an old folder)."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1; got {keep}")
    r = Path(root)
    rank, world = comm.world_rank(), comm.world_size()
    if saved_world is not None and world != 1:
        raise ValueError(f"a whole checkpoint of a world of {saved_world} is written by one process, not {world}")
    tmp = _begin(r, step)
    write(tmp)
    if saved_world is None:
        write_atomic(tmp / f"rng{rank}.pt", lambda f: torch.save(rng_state(), f))
    infos = comm.all_gather_object(
        {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in _owned(tmp, rank, world)}
    )
    files = {k: v for x in infos for k, v in x.items()}
    if rank == 0 and ".metadata" not in files:
        raise RuntimeError(f"checkpoint of step {step}: torch.distributed.checkpoint wrote no .metadata into {tmp}")
    marker = {
        "schema": SCHEMA,
        "version": VERSION,
        "step": step,
        "world_size": saved_world or world,
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
