"""`dcp-intra`: per-bucket SP degree and micro-batch size (a bucket whose micro-batch would
outlast the step's average load moves to a larger SP degree); micro-batches dealt to the
groups of their SP degree evenly by count (no time balancing).
"""

from __future__ import annotations

from typing import Sequence

from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp import DCPPlanner
from dcparallel.plan.steps import Step


def build(ctx: PlanContext, steps: Sequence[Step] = ()) -> DCPPlanner:
    return DCPPlanner(ctx, name="dcp-intra", mode="fit", balance=False, promote=True)
