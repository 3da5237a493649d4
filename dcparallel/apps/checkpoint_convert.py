"""The per-rank checkpoint format of dcparallel 0.1 (marker ``version`` 1), read for one
release only to convert it into the one format `dcparallel.checkpoint` writes and loads.

A version-1 step folder holds ``rankR.pt`` for each rank R of the world that saved it (a
shard_size-1 run): ``optimizer``, rank R's ZeRO-1 range ``[start, stop)`` of the flat
vector of the trainable parameters (`runtime.zero.ZeroAdamW.state_dict`: fp32 ``master``,
``exp_avg``, ``exp_avg_sq``, ``num_steps``, ``numel``), ``rng``, its RNG states, and on rank 0
``model``, the state dict without frozen parameters; plus ``COMMIT.json`` with each file's
bytes, sha256 and range, the step, the world size and the run's metadata.

`convert(root, model)` rewrites every whole version-1 folder under ``root`` in place as the
version-2 folder of the same step (one process, no process group): the flat vectors are
cut into the trainable parameters of ``model`` in ``named_parameters`` order (the order the
flat vector holds them in), so ``model/<name>`` gets the fp32 master values and
``optim/<name>/exp_avg[_sq]`` the moments (`runtime.sharded_checkpoint`'s keys), each
saved rank's RNG states go to its ``rngR.pt``, and the marker keeps the step, the world size
and the metadata; a resume from it continues as from the old folder. Rank 0's ``model``
parameters are not carried (the master values are the trained parameters); its persistent
buffers become ``buffer/<name>`` (`runtime.sharded_checkpoint`). A torn folder is left as it is
and named. `dcparallel convert-checkpoint --config run.toml` converts a `dcparallel train`
run's checkpoints (`apps.train_export.convert_run`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dcparallel import checkpoint
from dcparallel.runtime import comm
from dcparallel.runtime import sharded_checkpoint as dcp_tensors

_STATE = ("master", "exp_avg", "exp_avg_sq")


def read_per_rank(folder: Path, step: int) -> tuple[dict | None, list[dict] | str]:
    """(the marker, every rank's payload) of the version-1 folder of ``step``, or (None, why
    it is not a whole version-1 folder): every ``rankR.pt`` present with its committed bytes
    and sha256, read with ``torch.load(weights_only=True)``."""
    marker, why = checkpoint.read_marker(folder, step)
    if marker is None:
        return None, why
    if marker["version"] != checkpoint.VERSION_PER_RANK:
        return None, f"{folder} is not a per-rank (version {checkpoint.VERSION_PER_RANK}) checkpoint"
    world, files = int(marker["world_size"]), marker.get("files", {})
    if sorted(int(r) for r in files) != list(range(world)):
        return None, f"{folder}: the marker lists ranks {sorted(files)} for a world of {world}"
    for r in range(world):
        p, f = folder / f"rank{r}.pt", files[str(r)]
        if not p.exists() or p.stat().st_size != f["bytes"] or checkpoint.sha256(p) != f["sha256"]:
            return None, f"{folder}: rank{r}.pt is missing, torn or not the committed file"
    payloads = [torch.load(folder / f"rank{r}.pt", map_location="cpu", weights_only=True) for r in range(world)]
    return marker, payloads


def flat_state(shards: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The whole flat ``master`` / ``exp_avg`` / ``exp_avg_sq`` vectors and ``num_steps`` of
    every rank's ZeRO-1 shard; ValueError unless the ranges tile ``[0, numel)`` and the
    shards are of one step."""
    ordered = sorted((s for s in shards if int(s["stop"]) > int(s["start"])), key=lambda s: int(s["start"]))
    numel, end = int(shards[0]["numel"]), 0
    for s in ordered:
        if int(s["start"]) != end:
            raise ValueError(f"the optimizer shards leave elements [{end}, {s['start']}) of the flat vector uncovered")
        end = int(s["stop"])
    steps = {int(s["num_steps"]) for s in shards}
    if end != numel or len(steps) != 1:
        raise ValueError(f"the optimizer shards cover [0, {end}) of {numel} elements, of steps {sorted(steps)}")
    out = {k: torch.cat([s[k][: int(s["stop"]) - int(s["start"])] for s in ordered]) for k in _STATE}
    return {**out, "num_steps": torch.tensor([steps.pop()], dtype=torch.int64)}


def tensors(flat: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The version-2 tensors (`runtime.sharded_checkpoint`'s keys) of the flat state of the
    trainable parameters of ``model``; ValueError if the sizes differ (another model)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in trainable)
    if total != flat["master"].numel():
        raise ValueError(
            f"the checkpoint's optimizer state is for {flat['master'].numel()} parameters but this "
            f"model trains {total}; convert with the config the run was trained with"
        )
    out, off = {dcp_tensors.STEPS_KEY: flat["num_steps"]}, 0
    for name, p in trainable:
        shape = tuple(p.shape) or (1,)  # a 0-d parameter is stored with one dimension of 1
        piece = {k: flat[k][off : off + p.numel()].reshape(shape).clone() for k in _STATE}
        out[dcp_tensors.model_key(name)] = piece["master"]
        out.update({dcp_tensors.optim_key(name, k): piece[k] for k in ("exp_avg", "exp_avg_sq")})
        off += p.numel()
    return out


def buffers(saved: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The version-2 ``buffer/<name>`` tensors of the persistent buffers of ``model`` in rank 0's
    saved state dict ``saved`` (those it lacks are refused when the checkpoint is loaded)."""
    names = dcp_tensors.persistent_buffers(model)
    return {dcp_tensors.buffer_key(n): v.reshape(v.shape or (1,)).clone() for n, v in saved.items() if n in names}


def _write(folder: Path, state: dict[str, torch.Tensor], payloads: list[dict]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # DCP warns that it saves in one process: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), single_file_per_rank=True), no_dist=True)
    for r, payload in enumerate(payloads):
        checkpoint.write_atomic(folder / f"rng{r}.pt", lambda f, x=payload["rng"]: torch.save(x, f))


def convert(root: str | Path, model: nn.Module) -> tuple[list[int], list[str]]:
    """Rewrites every whole per-rank (version 1) checkpoint under ``root`` in place as the
    version-2 checkpoint of the same step (module docstring); one process, no process group.
    ``model``: the run's model as built (its trainable parameters name the flat vector's
    pieces). Returns (the converted steps, why each other version-1 folder was left)."""
    if comm.world_size() != 1:
        raise ValueError("convert a checkpoint in one process (not under torchrun)")
    done, left = [], []
    for step in checkpoint.committed_steps(root):
        folder = checkpoint.step_dir(Path(root), step)
        marker, _ = checkpoint.read_marker(folder, step)
        if marker is not None and marker["version"] != checkpoint.VERSION_PER_RANK:
            continue  # already in the one format
        marker, payloads = read_per_rank(folder, step)
        if marker is None:
            left.append(payloads)
            continue
        state = tensors(flat_state([p["optimizer"] for p in payloads]), model)
        state.update(buffers(payloads[0].get("model", {}), model))
        checkpoint.save(
            root,
            step,
            lambda tmp, s=state, ps=payloads: _write(tmp, s, ps),
            marker["meta"],
            shard_size=1,
            keep=None,
            saved_world=int(marker["world_size"]),
        )
        done.append(step)
    return sorted(done), left
