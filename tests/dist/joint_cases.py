"""Gloo worker functions for the joint-attention parity and epoch tests (module level, for spawn)."""

from __future__ import annotations

import torch.distributed as dist

from dcparallel.adapters import find_adapter
from dcparallel.api import DataCentricParallel
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.runtime.engine import Engine
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.spec import Layout, Recompute
from tests import adapter_models, joint_models
from tests.dist.cases_common import adapter_plan_steps, adapter_step, epoch_per_policy
from tests.joint_models import JOINT_KINDS, MIX, TEXT_TOKENS, JointVideoSet, build, item, make_data


def case_joint_engine(kind: str, seeds: list[int], num_samples: int) -> list[dict]:
    """Random plans (SP 1/2/4, idle ranks, uneven counts, phases, random recompute) of a joint
    attention model driven through its adapter: its collate, loss_fn and hooks."""
    return adapter_plan_steps(
        Engine(build(kind)), lambda seed: make_data(kind, num_samples, seed), item, seeds, num_samples
    )


def case_joint_epoch(kind: str, profile_path: str) -> dict:
    """Every policy trains one epoch of the mixed-resolution set (2 copies of the mix) at world
    2 through `prepare` (profiled once, the cache reused); per policy the (step, group, sample
    ids) this rank ran and the step losses."""
    shapes = MIX[kind] * 2

    def setup(policy: str):
        model = build(kind)
        dc = DataCentricParallel(model, policy=policy, research=True, memory_bytes=2**30, context_tokens=TEXT_TOKENS)
        return model, dc, JointVideoSet(shapes, model)

    return epoch_per_policy(setup, shapes, profile_path, kind)


def ring_plan(world: int, num_layers: int) -> StepPlan:
    """Three samples over ring attention: on the whole world, sample 0 at Ulysses world / 2 x
    ring 2 without recompute and sample 1 at ring = world recomputing every block; then
    sample 2 at ring 2 on the first half of the world (at world 2: SP 1 on rank 0)."""
    full, half = Recompute(num_layers, num_layers), world // 2
    wide = (MicroBatch((0,), Layout(world, 1, Recompute.none(), 2)), MicroBatch((1,), Layout(world, 1, full, world)))
    narrow = MicroBatch((2,), Layout(half, 1, ring=2 if half > 1 else 1))
    plan = StepPlan(
        0,
        (0, 1, 2),
        (
            GroupPlan(tuple(range(world)), wide, 0),
            GroupPlan(tuple(range(half)), (narrow,), 1),
            GroupPlan(tuple(range(half, world)), (), 1),
        ),
        0,
    )
    plan.validate(world)
    return plan


def case_joint_ring(kind: str, seed: int) -> dict:
    """One step of `ring_plan` through the model's adapter, with groups that offer ring: a
    joint video model (`tests.joint_models`) or an image model (`tests.adapter_models`)."""
    models = joint_models if kind in JOINT_KINDS else adapter_models
    model = models.build(kind)
    adapter = find_adapter(model)
    dc = Engine(model, adapter=adapter, groups=ProcessGroups(adapter.num_heads, ring=True))
    loss = adapter_step(
        dc, ring_plan(dist.get_world_size(), dc.adapter.spec.num_layers), models.make_data(kind, 3, seed), models.item
    )
    return {"loss": loss, "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}
