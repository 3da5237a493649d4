"""Saving and loading a parameter-sharded run (shard_size > 1) with `torch.distributed.checkpoint`.

The state is keyed by parameter name (FQN) and every tensor is a DTensor sharded like its
parameter, so `torch.distributed.checkpoint` reshards on load: a checkpoint saved at one
world size and shard size loads at another (each rank reads the pieces of its own shard):

    model/<name>                    the parameter (fp32 shard)
    optim/<name>/exp_avg, ...sq     Adam's moments, sharded like the parameter
    optim/num_steps                 a plain tensor (the same on every rank)

`ShardedAdamW` keeps the moments of one piece of the block shard per replica; saving
all-gathers them over the replicas into per-parameter shards (a transient 8 bytes per
parameter of the block shard), loading slices each rank's piece back out.

Only the tensors of the run: the loader position, RNG state, the commit protocol of
`dcparallel.checkpoint` and export of consolidated weights are not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dcparallel.runtime import comm

if TYPE_CHECKING:
    from dcparallel.runtime.engine import Engine
    from dcparallel.runtime.sharded_optim import ShardedAdamW

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _moment_dtensors(opt: ShardedAdamW) -> dict[str, dict[str, Any]]:
    """Per parameter name, its moments as DTensors sharded like the parameter (all-gathered
    over the replicas), backed by one buffer per moment."""
    from torch.distributed.tensor import DTensor

    gr = opt.grads
    out: dict[str, dict[str, Any]] = {n: {} for n in gr.names}
    for k in _MOMENTS:
        piece = getattr(opt, k)
        full = comm.all_gather_flat(piece, gr.replica_group) if gr.num_replicas > 1 else piece.clone()
        for n, p, (a, b) in zip(gr.names, gr.params, gr._ranges, strict=True):
            local = full[a:b].view(p.to_local().shape)
            out[n][k] = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                           run_check=False)
        out.setdefault("_buffers", {})[k] = full
    return out


def _state(engine: Engine, opt: ShardedAdamW) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if engine.shard_size <= 1 or opt.grads is not engine.grad_sync:
        raise ValueError("sharded checkpoints are for an engine with shard_size > 1 and its own optimizer "
                         "(engine.optimizer()); an unsharded run uses dcparallel.checkpoint")
    moments = _moment_dtensors(opt)
    buffers = moments.pop("_buffers")
    state: dict[str, Any] = {f"model/{n}": p for n, p in engine.model.named_parameters() if p.requires_grad}
    for n, m in moments.items():
        for k in _MOMENTS:
            state[f"optim/{n}/{k}"] = m[k]
    state["optim/num_steps"] = torch.tensor([opt.num_steps], dtype=torch.int64)
    return state, buffers


def save_sharded(path: str | Path, engine: Engine, opt: ShardedAdamW) -> None:
    """Writes the parameters and the optimizer state into the folder ``path`` (collective:
    every rank calls it; torch.distributed.checkpoint writes its metadata file once every rank
    has written its part)."""
    import torch.distributed.checkpoint as dcp

    state, _ = _state(engine, opt)
    dcp.save(state, checkpoint_id=str(path))


def load_sharded(path: str | Path, engine: Engine, opt: ShardedAdamW) -> None:
    """Loads a checkpoint written by `save_sharded` at any world size and shard size into this
    engine's parameters and optimizer (collective). The optimizer's hyperparameters (lr, ...)
    stay as constructed."""
    import torch.distributed.checkpoint as dcp

    state, buffers = _state(engine, opt)
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(path))
    opt.num_steps = int(state["optim/num_steps"][0])
    for k in _MOMENTS:  # the loaded per-parameter shards -> this replica's piece
        getattr(opt, k).copy_(buffers[k][opt._lo: opt._hi])
