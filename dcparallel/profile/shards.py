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

from dcparallel.cost.base import state_recipe
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
    return next(engine.model.parameters()).dtype  # the base's: fp32 adapters on a bf16 base compute in bf16


def state_bytes(engine: Engine, spec: ModelSpec, device: torch.device) -> float:
    """Model states per rank: the engine's recipe (`cost.base.state_recipe`) for its trainable
    and frozen parameter counts and dtypes. On a GPU the whole parameters a shard block
    gathers and the 16-bit weight copies of a forward under autocast are left out: the
    allocator's peak of every measured run already holds them; on CPU the saved-tensor meter
    does not count them (`measure.SavedTensorMeter`), so they are counted here."""
    s = shard_size(engine)
    n = sum(p.numel() for p in engine.params)
    frozen = [p for p in engine.model.parameters() if not p.requires_grad]
    f = sum(p.numel() for p in frozen)
    b = torch.empty((), dtype=compute_dtype(engine)).element_size()
    bt = 4 if s > 1 else engine.params[0].element_size()  # fp32 adapters on a bf16 base
    recipe = state_recipe(
        spec, comm.world_size(), s, num_params=n + f, frozen_params=f, bytes_per_value=b, trainable_bytes=bt
    )
    return recipe.states - (recipe.gathered + recipe.autocast if device.type == "cuda" else 0.0)


def meter(engine: Engine, base_bytes: float, limit_bytes: float | None) -> SavedTensorMeter:
    """The CPU activation meter of one run: the parameter buffers excluded (shard size 1: the
    flat buffer and its views; s > 1: the local shards, and every saved parameter, which is
    how FSDP's gathered layers reach autograd)."""
    if shard_size(engine) > 1:
        return SavedTensorMeter(
            exclude=[p.to_local() for p in engine.params],
            base_bytes=base_bytes,
            limit_bytes=limit_bytes,
            skip_parameters=True,
        )
    return SavedTensorMeter(exclude=[engine.flat_param, *engine.params], base_bytes=base_bytes, limit_bytes=limit_bytes)


def sync_group(engine: Engine):
    """The group of the step's gradient all-reduce: the world (s = 1), the replicas of this
    rank's shard (s > 1), None when one block holds the world (nothing to all-reduce)."""
    if shard_size(engine) > 1:
        return engine.grad_sync.replica_group
    return comm.WORLD
