"""`cost.refined.RefinedCost`: micro-batch times measured in the first steps correct the cost
model, so the plans' predicted step times move toward the measured ones. Deterministic: the
"measured" times come from a synthetic machine (the analytic model's price, transformed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.batch import Batches
from dcparallel.cost.refined import RefinedCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.sim.replay import predict_step, step_seconds
from dcparallel.spec import ClusterSpec, Recompute, Workload, llama_like

MODEL = llama_like("refine-test", num_layers=4, hidden=256, num_heads=4, ffn_hidden=688, vocab_size=1024)
CLUSTER = ClusterSpec(world_size=2, gpus_per_node=2, memory_bytes=2**33, intra_bw=1e10, inter_bw=1e10, name="cpu")
LENGTHS = tuple(int(x) for x in np.random.default_rng(0).lognormal(5.5, 1.0, 160).clip(32, 4096))


def affine(priced: float, sp: int) -> float:
    """The synthetic machine: 1.7x the price plus a fixed 20 ms (SP 1); 2.3x plus 35 ms (SP 2)."""
    return (1.7 * priced + 0.020) if sp == 1 else (2.3 * priced + 0.035)


def curved(priced: float, sp: int) -> float:
    """Not affine: short micro-batches relatively slower (a square-root overhead)."""
    return 1.5 * priced + 0.05 * math.sqrt(priced)


def measured_step(plan, cost, machine) -> float:
    """The slowest rank's sum of its micro-batches on ``machine`` (the step without the sync)."""
    return max(
        sum(
            machine(
                cost.terms([LENGTHS[i] for i in mb.sample_ids], mb.layout.sp).time(mb.layout.recompute), mb.layout.sp
            )
            for mb, _ in plan.work_of(r)
        )
        for r in range(CLUSTER.world_size)
    )


def plans(cost, steps):
    ctx = PlanContext(Workload(MODEL, LENGTHS), cost, CLUSTER)
    planner = make_planner("dcp", ctx, steps, score=step_seconds(ctx))
    return ctx, [planner.plan(s) for s in steps]


def errors(machine, observed_steps: int) -> tuple[float, float]:
    """Mean relative error of the predicted compute time of the later steps, before and after
    the micro-batches of the first ``observed_steps`` steps are observed."""
    inner = AnalyticCost(MODEL, CLUSTER)
    steps = form_steps(LENGTHS, seed=0, tokens_per_step=8192)
    refined = RefinedCost(inner)
    _, first = plans(refined, steps[:observed_steps])
    for plan in first:  # training runs these steps and times each micro-batch
        for mb in plan.micro_batches():
            sizes = [LENGTHS[i] for i in mb.sample_ids]
            refined.observe(
                sizes,
                mb.layout.sp,
                mb.layout.recompute,
                machine(inner.terms(sizes, mb.layout.sp).time(mb.layout.recompute), mb.layout.sp),
            )
    out = []
    for cost in (inner, refined):
        ctx, later = plans(cost, steps[observed_steps:])
        out.append(np.mean([abs(predict_step(p, ctx).compute_s / measured_step(p, inner, machine) - 1) for p in later]))
    return out[0], out[1]


def test_an_affine_machine_is_learned_exactly_in_a_few_steps():
    before, after = errors(affine, observed_steps=3)
    assert before > 0.4 and after < 1e-6


def test_a_curved_machine_is_approached():
    before, after = errors(curved, observed_steps=3)
    assert before > 0.3 and after < before / 4


def test_the_correction_keeps_larger_micro_batches_dearer_and_grids_equal_terms():
    inner = AnalyticCost(MODEL, CLUSTER)
    refined = RefinedCost(inner)
    for n in (64, 256, 1024, 4096):
        refined.observe([n], 1, Recompute(0, 0), affine(inner.terms([n], 1).time_none, 1))
    a, b = refined.correction(1)
    assert a == pytest.approx(1.7) and b == pytest.approx(0.020)
    assert refined.correction(2) == (a, b)  # a degree not observed yet: the machine's fit so far
    for n in (64, 4096):
        refined.observe([n], 2, Recompute(0, 0), affine(inner.terms([n], 2).time_none, 2))
    assert refined.correction(2) == pytest.approx((2.3, 0.035)) and refined.correction(1) == (a, b)
    times = [refined.terms_copies(300, k, 1).time_none for k in range(1, 20)]
    assert times == sorted(times)
    grid = refined.terms_grid(Batches.of(MODEL, [(300,), (300, 300)]), [1, 2])
    for i, sizes in enumerate([(300,), (300, 300)]):
        for j, sp in enumerate([1, 2]):
            assert grid.time_none[i, j] == pytest.approx(refined.terms(sizes, sp).time_none, rel=1e-12)
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        refined.observe([64], 1, Recompute(0, 0), 0.0)
