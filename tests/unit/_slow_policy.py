"""A research policy, `slow`, whose plans of every step after the first take a set time:
a stand-in for a planner busy with a large step (minutes for a big `dcp` step on a
loaded machine) when the training loop stops. Importing this module registers it, in
whichever process imports it: the planning process imports it as it unpickles the
`SlowMark` a test hangs on the cost model, so the policy exists there too."""

from __future__ import annotations

import time
from dataclasses import dataclass

from dcparallel.plan.policies import RESEARCH, PolicySpec, make_planner
from dcparallel.plan.types import Tuned


@dataclass(frozen=True)
class SlowMark:
    seconds: float
    """how long each plan of a step after step 0 takes"""


class SlowPlanner:
    def __init__(self, ctx, steps, score):
        self.inner = make_planner("packed", ctx, steps, score=score)
        self.seconds = ctx.cost.slow.seconds

    def plan(self, step):
        if step.index > 0:
            time.sleep(self.seconds)
        return self.inner.plan(step)


def _build(ctx, steps, score):
    return Tuned(SlowPlanner(ctx, steps, score))


RESEARCH.setdefault("slow", PolicySpec("slow", "test only: `packed`, each plan after step 0 taking "
                                               "cost.slow.seconds", _build))
