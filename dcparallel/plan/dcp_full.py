"""`dcp`: our planner — `dcp-inter-pac` plus two-phase steps (a step's widest micro-batches
first on wide groups, then its narrow ones on narrow groups over the same ranks), keeping
whichever plan of the step is predicted to finish first (see `dcparallel.plan.dcp`).
"""

from __future__ import annotations

from typing import Sequence

from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp import DCPPlanner
from dcparallel.plan.steps import Step


def build(ctx: PlanContext, steps: Sequence[Step] = ()) -> DCPPlanner:
    return DCPPlanner(ctx, name="dcp", mode="pac", balance=True, promote=True, phases=True)
