"""A research policy, `slow`, whose plans of every step after the first take a set time:
a stand-in for a planner busy with a large step (minutes for a big `dcp` step on a
loaded machine) when the training loop stops. Registered only where it is needed: in a
test by `SPEC` (monkeypatched into `RESEARCH`, so other tests see the usual table), in
the planning process as it unpickles the `SlowMark` a test hangs on the cost model."""

from __future__ import annotations

import time
from dataclasses import dataclass

from dcparallel.plan.policies import RESEARCH, PolicySpec, make_planner
from dcparallel.plan.types import Tuned


@dataclass(frozen=True)
class SlowMark:
    seconds: float
    """how long each plan of a step after step 0 takes"""

    def __reduce__(self):
        return _registered_mark, (self.seconds,)


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


SPEC = PolicySpec("slow", "test only: `packed`, each plan after step 0 taking cost.slow.seconds", _build)


def _registered_mark(seconds: float) -> SlowMark:
    RESEARCH.setdefault("slow", SPEC)  # in the planning process, which needs the policy
    return SlowMark(seconds)
