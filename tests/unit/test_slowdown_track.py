"""The tracked slowdown of a CPU-calibrated analytic model (`RefinedCost.observe_step`,
`data.refine.track_steps`): each step's measured micro-batch seconds against their prices
rescale the prices of the plans made after it, in the iterating process and in the planning
process, alike on every rank; a GPU's prices are never tracked. Two loaders in one process
act as ranks 0 and 1 (as in test_loader_refine.py); the machine's speed is injected per step
(it rises, then falls)."""

from __future__ import annotations

import statistics

import pytest
import torch

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.refined import RefinedCost
from dcparallel.data import refine
from dcparallel.plan.context import PlanContext
from dcparallel.profile import cpu_calibration as cc
from dcparallel.runtime import comm
from dcparallel.sim.replay import predict_step
from dcparallel.spec import Recompute, Workload

from ._models import TINY_LM, cluster, cost
from .test_loader_refine import MEMORY_MIB, TOKENS_PER_STEP, data

#: the machine's speed per step: wall seconds per launch-priced second (rises, then falls)
SPEED = [2.0, 2.0, 1.5, 1.0, 1.0, 1.0]


def expected_scale(k: int) -> float:
    """What prices step k: the median of the speeds of the (up to 3) steps fed before it."""
    seen = SPEED[max(0, k - refine.TRACK_STEPS) : k]
    return statistics.median(seen) if seen else 1.0


def cpu_priced(launch_slowdown: float | None = 2.0):
    """The tests' analytic model, marked as a CPU calibration's (a launch's slowdown) or not."""
    c = cost(TINY_LM, cluster(2, 2, memory_mib=MEMORY_MIB))
    if launch_slowdown is not None:
        c.launch_slowdown = launch_slowdown
    return c


def run(planning: str, monkeypatch, launch_slowdown: float | None = 2.0):
    """Both ranks' steps of one epoch, step k's micro-batches taking SPEED[k] x their launch price."""
    from dcparallel.data.loader import DataCentricLoader

    ds, lens = data()
    cl = cluster(2, 2, memory_mib=MEMORY_MIB)
    ranks = [
        DataCentricLoader(
            ds,
            lens,
            cost=cpu_priced(launch_slowdown),
            cluster=cl,
            rank=r,
            world_size=2,
            tokens_per_step=TOKENS_PER_STEP,
            planning=planning,
            predict=True,
            check_plans=0,
        )
        for r in (0, 1)
    ]
    plain, out = cpu_priced(None), []
    for s0, s1 in zip(*ranks, strict=True):
        out.append((s0, s1, ranks[0].context.cost.scale if launch_slowdown else 1.0))
        times = [
            [
                SPEED[s0.index] * plain.terms([lens[i] for i in mb.sample_ids], mb.layout.sp).time(mb.layout.recompute)
                for mb, _ in s.plan.work_of(r)
            ]
            for r, s in enumerate((s0, s1))
        ]
        monkeypatch.setattr(comm, "all_gather_object", lambda obj, t=times: t)
        assert [ld.observe(s, times[r]) for r, (ld, s) in enumerate(zip(ranks, (s0, s1)))] == [
            launch_slowdown is not None
        ] * 2
    for ld in ranks:
        ld.close()
    return ranks, out


def test_the_scale_follows_step_times_up_and_down():
    c = cpu_priced(None)
    refined = RefinedCost(c, track=refine.TRACK_STEPS)
    rec = Recompute(0, 0)
    for k, speed in enumerate(SPEED):
        assert refined.scale == pytest.approx(expected_scale(k), rel=1e-12), k
        for n, sp in ((2048, 1), (9000, 2)):  # every price is the launch's times the scale
            assert refined.terms([n], sp).time(rec) == pytest.approx(expected_scale(k) * c.terms([n], sp).time(rec))
        refined.observe_step([([n], 1, rec, speed * c.terms([n], 1).time(rec)) for n in (300, 2048, 5000)])
    assert [expected_scale(k) for k in range(len(SPEED))] == [1.0, 2.0, 2.0, 2.0, 1.5, 1.0]  # up, then down
    assert refined.scale == pytest.approx(1.0)  # the last three steps' speed
    with pytest.raises(ValueError, match="track > 0"):
        RefinedCost(c).observe_step([])


@pytest.mark.parametrize("planning", ["thread", "process"])
def test_plans_after_a_step_are_priced_at_its_slowdown(planning, monkeypatch):
    ranks, steps = run(planning, monkeypatch)
    assert len(steps) == len(SPEED)
    work = Workload(TINY_LM, tuple(data()[1]))
    launch = PlanContext(work, cpu_priced(None), cluster(2, 2, memory_mib=MEMORY_MIB))
    for s0, s1, scale in steps:
        assert s0.plan.to_json() == s1.plan.to_json() and s0.predicted == s1.predicted
        assert scale == pytest.approx(expected_scale(s0.index), rel=1e-12)
        # made where its plan was (the planning process, or this one), on the steps fed before it
        at_launch = predict_step(s0.plan, launch).compute_s
        assert s0.predicted.compute_s == pytest.approx(scale * at_launch, rel=1e-9), s0.index
    assert {round(scale, 6) for *_, scale in steps} >= {1.0, 2.0, 1.5}
    assert all(ld.tracking == refine.TRACK_STEPS for ld in ranks)


def test_gpu_prices_are_not_tracked(monkeypatch):
    ranks, steps = run("thread", monkeypatch, launch_slowdown=None)  # observe answers False: no collective
    assert all(ld.tracking == 0 and not isinstance(ld.context.cost, RefinedCost) for ld in ranks)
    golden = [p.to_json() for p in ranks[0].plans(0)]
    assert [s0.plan.to_json() for s0, _, _ in steps] == golden
    spec, cl = TINY_LM, cluster(2, 2)
    gpu = cc.analytic_cost(spec, cl, torch.device("cuda"), "unused/profile.json")
    assert type(gpu) is AnalyticCost and refine.track_steps(gpu) == 0
    monkeypatch.setattr(cc, "launch_calibration", lambda *a: (gpu.cal, 2.5))
    monkeypatch.setattr(cc, "cpu_cluster", lambda cluster, cache: cluster)
    monkeypatch.setenv("DCPARALLEL_CPU_CALIBRATION", "1")  # the tests' default is the packaged one
    cpu = cc.analytic_cost(spec, cl, torch.device("cpu"), "unused/profile.json")
    assert cpu.launch_slowdown == 2.5 and refine.track_steps(cpu) == refine.TRACK_STEPS


def test_an_unfed_loop_ends_tracking():
    from dcparallel.data.loader import DataCentricLoader

    ds, lens = data()
    cl = cluster(1, 1, memory_mib=1536)  # one rank: every sample fits at SP 1
    c = cost(TINY_LM, cl)
    c.launch_slowdown = 2.0
    tracked = DataCentricLoader(ds, lens, cost=c, cluster=cl, tokens_per_step=TOKENS_PER_STEP, planning="thread")
    assert tracked.tracking == refine.TRACK_STEPS
    assert [s.plan.to_json() for s in tracked] == [p.to_json() for p in tracked.plans(0)]
    assert tracked.tracking == 0 and tracked.context.cost.scale == 1.0
