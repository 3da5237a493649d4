"""The loader's lookahead hides planning: with a planner slower than any real step plan but
faster than the training step, no step after the first waits for its plan (the plan of step
k + 1 is made while step k trains); without lookahead every step does. The waits are the
stream's own record (`PlanStream.waited`, `ProcessPlanStream.waited`: the plan was not there
when the loop asked), so the margins below (a 0.1 s plan against a 0.4 s step) only have to
hold, not be measured. The planning process gets the real planner (a class defined here
does not reach it): its record is checked the same way."""

import time

import pytest

from dcparallel.data import DataCentricLoader

from ._models import TINY_LM, cluster, cost
from .test_loader import text_data

PLAN_S, STEP_S = 0.1, 0.4


class SlowPlanner:
    """A real planner whose every plan takes ``PLAN_S`` seconds longer."""

    def __init__(self, planner):
        self.inner, self.name = planner, planner.name

    def plan(self, step):
        time.sleep(PLAN_S)
        return self.inner.plan(step)

    def describe(self) -> dict:
        return self.inner.describe()


def slow_loader(lookahead: int, planning: str) -> DataCentricLoader:
    ds, lens = text_data(24, seed=3)
    cl = cluster(2, 2, memory_mib=1536)
    loader = DataCentricLoader(
        ds,
        lens,
        cost=cost(TINY_LM, cl),
        cluster=cl,
        rank=0,
        world_size=2,
        tokens_per_step=8000,
        lookahead=lookahead,
        planning=planning,
    )
    if planning == "thread":
        build = loader.planner
        loader.planner = lambda epoch: SlowPlanner(build(epoch))
    return loader


@pytest.mark.parametrize("lookahead,planning", [(0, "thread"), (2, "thread"), (2, "process")])
def test_no_step_waits_for_a_slow_plan_with_lookahead(lookahead, planning):
    loader = slow_loader(lookahead, planning)
    n = 0
    for _ in loader:
        time.sleep(STEP_S)  # the training step
        n += 1
    assert n >= 4
    if lookahead:
        assert loader.last_plan_waits == [0]  # only the first step: nothing ran before it
    else:
        assert loader.last_plan_waits == list(range(n))
    if planning == "thread":
        assert loader.last_plan_seconds >= n * PLAN_S
