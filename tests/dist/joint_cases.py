"""Gloo worker functions for the joint-attention parity and epoch tests (module level, for spawn)."""

from __future__ import annotations

from dcparallel.api import DataCentricParallel
from dcparallel.runtime.engine import Engine
from tests.dist.cases_common import adapter_plan_steps, epoch_per_policy
from tests.joint_models import MIX, TEXT_TOKENS, JointVideoSet, build, item, make_data


def case_joint_engine(kind: str, seeds: list[int], num_samples: int) -> list[dict]:
    """Random plans (SP 1/2/4, idle ranks, uneven counts, phases, random recompute) of a joint
    attention model driven through its adapter: its collate, loss_fn and hooks."""
    return adapter_plan_steps(Engine(build(kind)), lambda seed: make_data(kind, num_samples, seed), item, seeds,
                              num_samples)


def case_joint_epoch(kind: str, profile_path: str) -> dict:
    """Every policy trains one epoch of the mixed-resolution set (2 copies of the mix) at world
    2 through `prepare` (profiled once, the cache reused); per policy the (step, group, sample
    ids) this rank ran and the step losses."""
    shapes = MIX[kind] * 2

    def setup(policy: str):
        model = build(kind)
        dc = DataCentricParallel(model, policy=policy, memory_bytes=2**30, context_tokens=TEXT_TOKENS)
        return model, dc, JointVideoSet(shapes, model)

    return epoch_per_policy(setup, shapes, profile_path)
