"""The step lower bound (`plan/bounds.py`): where steps hold about one sample per GPU its midpoint
and per-rank parts raise it above the simple bound, no plan any policy makes beats it, and its
LP answers agree with exact solutions."""

from __future__ import annotations

from functools import partial
from unittest.mock import patch

import numpy as np
import pytest

from benchmarks.tight_bound import TightBound, build_cell, lp_exact, random_lp
from dcparallel.plan.bounds import (
    PER_RANK_STEPS,
    TIGHT_PER_GPU,
    LowerBound,
    dff,
    lp_value,
    per_rank_feasible,
    step_dff,
    threshold_sums,
)
from dcparallel.plan.policies import make_planner
from dcparallel.plan.shape_bound import bisect_too_short
from dcparallel.plan.steps import Step
from dcparallel.scenarios import SCENARIOS
from dcparallel.sim.replay import simulate, step_seconds

WORLD = 16
#: (scenario, distribution, the 32-GPU step budget divided by): 0.2-3 samples per GPU at 16 GPUs,
#: the regime of the scale report's strong 128-512 GPU cells
CELLS = [("text", "long", 32), ("text", "short", 32), ("video", "long", 8), ("video", "balanced", 16)]
POLICIES = ["dcp", "bucket", "packed", "megatron-dcp", "hbp"]


@pytest.fixture(scope="module")
def cells():
    rng = np.random.default_rng(0)
    out = []
    for scenario, dist, div in CELLS:
        ctx, steps = build_cell(scenario, dist, WORLD, SCENARIOS[scenario].tokens_per_step // div, 4)
        steps = steps[:3]
        for _ in range(3):  # and a few random small steps
            ids = rng.choice(len(ctx.sizes), size=int(rng.integers(2, 11)), replace=False)
            steps.append(Step(len(steps), tuple(sorted(int(i) for i in ids))))
        out.append((scenario, dist, ctx, steps))
    return out


@pytest.fixture(scope="module")
def bounds(cells):
    """Per cell its `LowerBound` and each step's compute bound, computed once (the per-rank
    part takes seconds on video steps)."""
    out = []
    for _, _, ctx, steps in cells:
        lb = LowerBound(ctx)
        out.append((lb, {s.index: lb.compute(s) for s in steps}))
    return out


def test_the_bound_rises_above_the_simple_bound_where_steps_hold_few_samples_per_gpu(cells, bounds):
    for (scenario, dist, _, steps), (lb, compute) in zip(cells, bounds):
        ratios = [compute[s.index] / lb.simple(s) for s in steps]
        assert min(ratios) >= 1.0 - 1e-12, (scenario, dist, ratios)
        assert max(ratios) > 1.05, (scenario, dist, ratios)  # the midpoint (text) or per-rank (video) part
        for s in steps:
            if len(s.sample_ids) > TIGHT_PER_GPU * WORLD:  # the per-rank LP stops; the midpoint goes on
                assert compute[s.index] == max(lb.simple(s), lb.midpoint(s)), (scenario, dist, s.index)


def test_no_policy_plans_a_step_faster_than_its_bound(cells, bounds):
    """Every policy's plan of every step (the scenarios' steps and random small ones), simulated
    alone, takes at least the step's bound; and every video micro-batch holds one latent shape,
    which the per-rank bound assumes (the collate stacks same-shape samples)."""
    for (scenario, dist, ctx, steps), (lb, compute) in zip(cells, bounds):
        bound = {i: lb.with_sync(c) for i, c in compute.items()}  # = lb.step
        for name in POLICIES:
            planner = make_planner(name, ctx, steps, score=step_seconds(ctx))
            for s in steps:
                plan = planner.plan(s)
                plan.validate(WORLD)
                if scenario == "video":  # the per-rank bound's one assumption
                    for mb in plan.micro_batches():
                        assert len({ctx.bucket_of[i] for i in mb.sample_ids}) == 1, (name, "mixes shapes")
                sim = simulate([plan], ctx).total_time
                assert sim >= bound[s.index] * (1 - 1e-9), (scenario, dist, name, s.index, sim, bound[s.index])


def test_the_midpoint_search_equals_an_exact_scan(cells):
    """The binary search over breakpoints with the cutting-plane dual gives what a scan of every
    interval with an exact primal LP gives."""
    for scenario, dist, ctx, steps in cells:
        tb = TightBound(ctx)
        for s in steps:
            got, want = tb.midpoint_raw(s), tb.midpoint_raw(s, exact=True)
            assert abs(got - want) <= 1e-9 * want, (scenario, dist, s.index, got, want)
            assert got >= tb.tight(s) * (1 - 1e-9) and tb.tight(s) >= tb.simple(s) * (1 - 1e-12)


def test_the_cutting_plane_dual_equals_the_exact_primal_on_random_lps():
    rng = np.random.default_rng(1)
    binding = 0
    for _ in range(300):
        G, R, cnt, world = random_lp(rng)
        got, want = lp_value(G, R, cnt, world), lp_exact(G, R, cnt, world)
        assert (got == want == np.inf) or abs(got - want) <= 1e-9 * abs(want), (got, want)
        binding += bool(np.isfinite(want)) and want > (cnt * G.min(axis=1)).sum() * (1 + 1e-9)
    assert binding > 30  # the rank limit decides in many of them, not only the work


def test_a_rank_limit_met_exactly_is_feasible_despite_rounding():
    """Ten long samples of 1/10 midpoint rank each fill a world of 1 exactly; their float sum
    is a few ulps above 1. The LP is feasible at its limit, so its value is the work, not the
    ever-rising dual a strict slope test would follow (that made the midpoint bound of a
    world-1 step twice the time of the plan `dcp` made for it)."""
    G = np.array([[4.1e-4], [6.4e-7], [7.5e-7], [7.1e-7], [6.0e-7], [1.1e-4], [9.0e-7], [1.7e-3], [3.6e-6]])
    R = np.array([[0.1], [0.1], [0.1], [0.1], [0.0], [0.1], [0.1], [0.1], [0.1]])
    cnt = np.array([1.0, 3.0, 1.0, 1.0, 6.0, 1.0, 1.0, 1.0, 1.0])  # the step's sizes and counts
    assert float((cnt * R[:, 0]).sum()) > 1.0  # the rounding this test is about
    want = lp_exact(G, R, cnt, 1.0)
    assert np.isfinite(want)
    assert abs(lp_value(G, R, cnt, 1.0) - want) <= 1e-9 * want


def test_threshold_sums_equal_the_dense_sums():
    """The per-rank LP checks a mix against every threshold by prefix sums; the same sums as
    through the [threshold, option] matrix of u_e (which at thousands of options would not fit
    in memory)."""
    rng = np.random.default_rng(2)
    for _ in range(50):
        n = int(rng.integers(1, 200))
        x = np.sort(np.concatenate([rng.uniform(0, 1, n), rng.choice([0.25, 0.5, 0.75], 5)]))
        a = rng.uniform(0, 3, len(x)) * (rng.random(len(x)) < 0.7)
        es = np.unique(np.concatenate([[0.0, 0.25, 0.5], x[x <= 0.5], 1.0 - x[x >= 0.5]]))
        dense = (a[None, :] * dff(x[None, :], es[:, None])).sum(axis=1)
        assert np.allclose(threshold_sums(x, a, es), dense, rtol=1e-12, atol=1e-12)


def test_the_step_functions_are_dual_feasible():
    """u^(q) of sizes summing to at most 1 sums to at most 1: random sets, and sets of exact
    fractions j / (q + 1) filling 1 (where the floor without its margin would count q + 1)."""
    rng = np.random.default_rng(3)
    q = np.arange(1, PER_RANK_STEPS + 1)[:, None]
    for _ in range(2000):
        x = rng.dirichlet(np.ones(int(rng.integers(1, 12)))) * rng.uniform(0.5, 1.0)
        assert (step_dff(x[None, :], q).sum(axis=1) <= 1.0).all(), x
    for k in range(1, PER_RANK_STEPS + 2):
        for parts in range(1, k + 2):
            x = np.full(parts, 1.0 / parts)
            assert (step_dff(x[None, :], q).sum(axis=1) <= 1.0).all(), (k, parts)
    x = np.linspace(0, 1, 1001)
    assert (np.diff(step_dff(x[None, :], q), axis=1) >= 0).all()  # non-decreasing: a longer micro-batch counts more


def test_the_step_functions_prove_what_the_thresholds_cannot():
    """Five micro-batches of 0.4 s on 2 ranks: their 2 s of work fits, and every threshold
    function u_e lets them, but a rank holds only two: 1 s is too short (u^(2) counts 1/2
    each), 1.2 s is not (three on one rank)."""
    opts = [(5, np.array([[1.0, 1.0, 0.4]]))]  # 5 samples, one option: degree 1, 1 copy, 0.4 s
    assert not per_rank_feasible(opts, 1.0, 2.0)
    assert per_rank_feasible(opts, 1.2, 2.0)
    with patch("dcparallel.plan.bounds.PER_RANK_STEPS", 0):  # thresholds alone
        assert per_rank_feasible(opts, 1.0, 2.0)


def test_the_per_rank_bound_never_exceeds_a_brute_force_optimum():
    """Random small steps on 1-3 ranks of degree 1: shapes of a few samples, each micro-batch of
    1-3 copies of its shape (time rising with copies, below linear); the per-rank bound (u_e and
    u^(q) together) is at most the best schedule found by trying every split into
    micro-batches and every assignment to ranks; and the step functions raise it on some."""
    rng = np.random.default_rng(4)
    raised = 0
    for _ in range(60):
        world = int(rng.integers(1, 4))
        shapes = []
        for _ in range(int(rng.integers(1, 3))):
            n, t1 = int(rng.integers(1, 4)), float(rng.uniform(0.1, 1.0))
            times = {m: t1 * m ** float(rng.uniform(0.6, 1.0)) for m in range(1, n + 1)}
            shapes.append((n, times))
        opts = [(n, np.array([[1.0, m, t] for m, t in times.items()])) for n, times in shapes]
        best = _brute_force_makespan(shapes, world)
        feasible = partial(per_rank_feasible, opts, world=float(world))
        lo = max(float(o[:, 2].min()) for _, o in opts) * 0.5  # (nothing runs this fast)
        bound = bisect_too_short(feasible, lo, best * (1 + 1e-6))
        assert bound <= best * (1 + 1e-9), (shapes, world, bound, best)
        with patch("dcparallel.plan.bounds.PER_RANK_STEPS", 0):  # the thresholds alone
            raised += bound > bisect_too_short(feasible, lo, best) * (1 + 1e-6)
    assert raised >= 2


def _brute_force_makespan(shapes, world: int) -> float:
    """The least makespan of the shapes' samples as one-shape micro-batches on `world` ranks."""
    from itertools import product

    def splits(n):  # the ways to cut n copies into micro-batches (counts, descending)
        if n == 0:
            yield ()
            return
        for m in range(n, 0, -1):
            for rest in splits(n - m):
                if not rest or rest[0] <= m:
                    yield (m, *rest)

    best = np.inf
    for cut in product(*[list(splits(n)) for n, _ in shapes]):
        items = [times[m] for (_, times), parts in zip(shapes, cut) for m in parts]
        for ranks in product(range(world), repeat=len(items)):
            load = np.zeros(world)
            np.add.at(load, list(ranks), items)
            best = min(best, float(load.max()))
    return best
