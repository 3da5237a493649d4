"""What the profiler measures differently for an engine with parameter-shard blocks
(`runtime.sharded`, shard size s > 1), next to the same quantities at shard size 1.

The runs themselves are the engine's: FSDP2 all-gathers each layer's parameters for its
forward and backward and reduce-scatters its gradients inside the block, so a measured
micro-batch includes them (layers skipped for the depth extrapolation run no collective:
`measure.active_depth`). The SP degrees are the launch topology's, all multiples of s, so the
ranks of a block are always in one measured group. Per rank the model states are the
engine's sharded recipe (`state_bytes`), and the step's gradient sync is the all-reduce of
this rank's gradient shards over the replicas of its shard (`sync_group`).
"""

from __future__ import annotations

import torch

from dcparallel.cost.base import gathered_bytes
from dcparallel.profile.measure import SavedTensorMeter
from dcparallel.runtime import comm
from dcparallel.runtime.engine import Engine
from dcparallel.spec import ModelSpec


def shard_size(engine: Engine) -> int:
    return int(getattr(engine, "shard_size", 1))


def compute_dtype(engine: Engine) -> torch.dtype:
    """The dtype the model computes in: with shard blocks the stored shards are fp32 (the
    master weights) and FSDP casts them to the model's own dtype for compute."""
    if shard_size(engine) > 1:
        return engine.grad_sync.compute_dtype
    return engine.params[0].dtype


def state_bytes(engine: Engine, spec: ModelSpec, device: torch.device) -> float:
    """Model states per rank, the engine's recipe. Shard size 1: the parameters, the fp32
    gradient buffer, and the ZeRO-1 shard of fp32 master weights (none for fp32 parameters)
    + Adam moments. Shard size s > 1: fp32 parameter shards (also the master weights) and fp32
    gradient shards, 1/s of the parameters each, plus the Adam moments (8 bytes a parameter)
    over the world (`runtime.sharded_optim`); on CPU the whole parameters a layer gathers are
    added too (`cost.base.gathered_bytes`): the saved-tensor meter does not see them; on a GPU
    the allocator's peak of every measured run already holds them."""
    if shard_size(engine) == 1:
        n = sum(p.numel() for p in engine.params)
        dtype = engine.params[0].dtype
        master = 0 if dtype == torch.float32 else 4
        return float(n * (engine.params[0].element_size() + 4 + (master + 8) / comm.world_size()))
    g = engine.grad_sync
    local = sum(p.to_local().numel() for p in g.params)
    states = 4.0 * local + 4.0 * g.flat_grad.numel() + 8.0 * g.numel / comm.world_size()
    return states + (gathered_bytes(spec) if device.type != "cuda" else 0.0)


def meter(engine: Engine, base_bytes: float, limit_bytes: float | None) -> SavedTensorMeter:
    """The CPU activation meter of one run: the parameter buffers excluded (shard size 1: the
    flat buffer and its views; s > 1: the local shards, and every saved parameter, which is
    how FSDP's gathered layers reach autograd)."""
    if shard_size(engine) > 1:
        return SavedTensorMeter(exclude=[p.to_local() for p in engine.params], base_bytes=base_bytes,
                                limit_bytes=limit_bytes, skip_parameters=True)
    return SavedTensorMeter(exclude=[engine.flat_param, *engine.params], base_bytes=base_bytes,
                            limit_bytes=limit_bytes)


def sync_group(engine: Engine):
    """The group of the step's gradient all-reduce: the world (s = 1), the replicas of this
    rank's shard (s > 1), None when one block holds the world (nothing to all-reduce)."""
    if shard_size(engine) > 1:
        return engine.grad_sync.replica_group
    return comm.WORLD
