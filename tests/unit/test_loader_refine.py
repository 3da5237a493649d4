"""The loader's online refinement (`refine_steps`, `DataCentricLoader.observe`): micro-batch
times measured in the first steps reach the cost model that plans the later steps, in the
iterating process and in the planning process, and every rank plans alike. Two loaders in
one process act as ranks 0 and 1 of a world of 2; the world's gather of their times is
injected (the gloo run of the same gather: tests/dist/test_dist_loader.py). The measured
times are synthetic: each micro-batch's analytic price, scaled and offset per SP degree,
with a square-root term so that each step's rows move the fit."""

from __future__ import annotations

import math

import pytest

from dcparallel.cost.refined import RefinedCost
from dcparallel.plan.context import PlanContext
from dcparallel.runtime import comm
from dcparallel.sim.replay import predict_step
from dcparallel.spec import Recompute, Workload

from ._models import TINY_LM, cluster, cost
from .test_loader import make, text_data

REFINE = 3
TOKENS_PER_STEP = 60_000
MEMORY_MIB = 400


def data():
    """Text of 200 to 24k tokens: under MEMORY_MIB the long samples need SP 2, the short fit SP 1."""
    return text_data(40, seed=5, lo=200, hi=24_000)


def loader(rank: int, **kw):
    ds, lens = data()
    return make(ds, lens, world=2, rank=rank, tokens_per_step=TOKENS_PER_STEP, memory_mib=MEMORY_MIB, **kw)


def inner():
    return cost(TINY_LM, cluster(2, 2, memory_mib=MEMORY_MIB))


def machine(price: float, sp: int) -> float:
    """The synthetic machine: 1.7x the price at SP 1, 2.3x at SP 2, plus 20 ms x SP and a
    square-root overhead."""
    return (1.7 if sp == 1 else 2.3) * price + 0.02 * sp + 0.05 * math.sqrt(price)


def seconds(plan, rank: int) -> list[float]:
    """What the rank's micro-batches of ``plan`` take on the synthetic machine, in order."""
    lens, c = data()[1], inner()
    return [
        machine(c.terms([lens[i] for i in mb.sample_ids], mb.layout.sp).time(mb.layout.recompute), mb.layout.sp)
        for mb, _ in plan.work_of(rank)
    ]


def measured_compute(plan) -> float:
    """The slowest rank's micro-batches on the synthetic machine."""
    return max(sum(seconds(plan, r)) for r in (0, 1))


def run(refine_steps: int, planning: str, monkeypatch, feed: bool = True):
    """Both ranks' steps of one epoch, each step fed (both ranks' times, gathered) when ``feed``."""
    ranks = [loader(r, planning=planning, predict=True, refine_steps=refine_steps, check_plans=0) for r in (0, 1)]
    out = []
    for s0, s1 in zip(*ranks, strict=True):
        out.append((s0, s1))
        if feed:
            times = [seconds(s0.plan, 0), seconds(s1.plan, 1)]
            monkeypatch.setattr(comm, "all_gather_object", lambda obj, t=times: t)
            fed = [ld.observe(s, times[r]) for r, (ld, s) in enumerate(zip(ranks, (s0, s1)))]
            assert fed == [s0.index < refine_steps] * 2
    for ld in ranks:
        ld.close()
    return ranks, out


def reference_prediction(steps, k: int) -> float:
    """Step k's predicted compute time on a `RefinedCost` fed, here, every micro-batch of the
    steps before it (up to REFINE), each at the lowest rank of its group."""
    lens, refined = data()[1], RefinedCost(inner())
    for s0, _ in steps[: min(k, REFINE)]:
        for r in (0, 1):
            for (mb, ranks), t in zip(s0.plan.work_of(r), seconds(s0.plan, r), strict=True):
                if r == min(ranks):
                    refined.observe(
                        [lens[i] for i in mb.sample_ids],
                        mb.layout.sp,
                        Recompute(mb.layout.recompute.attn, mb.layout.recompute.mlp),
                        t,
                    )
    ctx = PlanContext(Workload(TINY_LM, tuple(lens)), refined, cluster(2, 2, memory_mib=MEMORY_MIB))
    return predict_step(steps[k][0].plan, ctx).compute_s


@pytest.mark.parametrize("planning", ["thread", "process"])
def test_measured_times_reach_the_planner_and_every_rank_plans_alike(planning, monkeypatch):
    ranks, steps = run(REFINE, planning, monkeypatch)
    _, plain = run(0, planning, monkeypatch, feed=False)
    assert len(steps) > REFINE + 2
    assert {mb.layout.sp for s, _ in steps for mb in s.plan.micro_batches()} == {1, 2}
    for s0, s1 in steps:
        assert s0.plan.to_json() == s1.plan.to_json()
        assert s0.predicted == s1.predicted
    assert all(ld.refine_left == 0 for ld in ranks)
    # each prediction, made where its plan was (the planning process, or this one), is on the
    # fit of exactly the steps before it
    for k in range(len(steps)):
        assert steps[k][0].predicted.compute_s == pytest.approx(reference_prediction(steps, k), rel=1e-9), k

    def error(pairs, k):
        s = pairs[k][0]
        return abs(s.predicted.compute_s / measured_compute(s.plan) - 1)

    before = [error(plain, k) for k in range(REFINE, len(steps))]
    after = [error(steps, k) for k in range(REFINE, len(steps))]
    print(
        f"relative error of the predicted compute time, steps {REFINE}..{len(steps) - 1}: unrefined "
        f"{min(before):.3f}-{max(before):.3f}, refined {min(after):.1e}-{max(after):.1e}"
    )
    assert min(before) > 0.3, before  # the unrefined price is far from the synthetic machine
    assert max(after) < 0.05, after


def test_refine_steps_0_and_an_unfed_loop_leave_the_plans_unchanged(monkeypatch):
    golden = [p.to_json() for p in loader(0).plans(0)]
    for refine_steps, feed in ((0, True), (REFINE, False)):
        ranks, steps = run(refine_steps, "thread", monkeypatch, feed=feed)
        assert [s0.plan.to_json() for s0, _ in steps] == golden
        assert all(ld.refine_left == 0 for ld in ranks)  # an unfed loop ends refining


def test_a_resumed_loader_plans_with_the_saved_fits(monkeypatch):
    ranks, steps = run(REFINE, "thread", monkeypatch)
    resumed = loader(0, planning="thread", predict=True, refine_steps=REFINE, check_plans=0)
    resumed.load_state_dict(dict(ranks[0].state_dict(), epoch=0, step=REFINE + 1))
    assert resumed.refine_left == 0
    assert [(s.index, s.plan.to_json(), s.predicted) for s in resumed] == [
        (s.index, s.plan.to_json(), s.predicted) for s, _ in steps[REFINE + 1 :]
    ]


def test_refine_steps_must_be_a_count():
    with pytest.raises(ValueError, match="refine_steps must be an integer >= 0"):
        loader(0, refine_steps=-1)
