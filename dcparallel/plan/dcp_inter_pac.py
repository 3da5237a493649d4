"""`dcp-inter-pac`: `dcp-inter` plus per-micro-batch recomputation from spare memory (PAC: a
knapsack over layers x {attention, MLP}).
"""

from __future__ import annotations

from typing import Sequence

from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp import DCPPlanner
from dcparallel.plan.steps import Step


def build(ctx: PlanContext, steps: Sequence[Step] = ()) -> DCPPlanner:
    return DCPPlanner(ctx, name="dcp-inter-pac", mode="pac", balance=True, promote=True)
