"""`dcp-inter`: `dcp-intra` plus per-group gradient accumulation: micro-batches dealt by time
so every group finishes together, then moved off the slowest group where they finish earlier.
"""

from __future__ import annotations

from typing import Sequence

from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp import DCPPlanner
from dcparallel.plan.steps import Step


def build(ctx: PlanContext, steps: Sequence[Step] = ()) -> DCPPlanner:
    return DCPPlanner(ctx, name="dcp-inter", mode="fit", balance=True, promote=True)
