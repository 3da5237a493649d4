"""The per-sample rows of the paper's ablation table: `dcp-intra`, `dcp-inter`,
`dcp-inter-pac`, `dcp-v1` — `dcp`'s per-sample planner (`plan.dcp.per_sample`) with
balancing, partial recompute and two-phase steps switched on one at a time:

- `dcp-intra`: each bucket at its own SP degree and micro-batch size, micro-batches dealt
  round-robin by count, recompute `fit`;
- `dcp-inter`: + micro-batches dealt longest first to the least-loaded group and moved off
  the slowest one (per-group gradient accumulation balancing the step);
- `dcp-inter-pac`: + per-micro-batch partial recompute from spare memory (a knapsack);
- `dcp-v1`: + two-phase steps; the per-sample planner `dcp` itself offers on small clusters.
"""

from __future__ import annotations

from typing import Sequence

from dcparallel.plan.context import PlanContext, RecomputeMode
from dcparallel.plan.dcp.per_sample import PerSamplePlanner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import Score, Tuned


def per_sample_row(name: str, mode: RecomputeMode, *, balance: bool, phases: bool = False):
    """The policy builder of one row (`plan.policies.PolicySpec.build`)."""

    def build(ctx: PlanContext, steps: Sequence[Step], score: Score) -> Tuned:
        return Tuned(PerSamplePlanner(ctx, name=name, mode=mode, balance=balance, promote=True, phases=phases))

    return build
