"""`flexsp` (FlexSP-style optimal assignment, `plan/research/flexsp.py`): its program's optimum equals
an exhaustive search on tiny steps, its plans are lossless, tile the world and fit memory, and
its fallback (no solution in time) plans every sample too; random small steps (hypothesis)
keep those properties."""

from __future__ import annotations

import itertools
import math
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.research.flexsp import NODE_LIMIT, FlexSPPlanner
from dcparallel.plan.steps import Step, form_steps
from dcparallel.sim.replay import simulate, step_seconds
from dcparallel.spec import Workload

from ._models import TINY_DIT, TINY_LM, cluster, cost, draw_samples
from .test_policies import _check


def _class_makespan(p: FlexSPPlanner, plan) -> float:
    """A plan's slowest group in the program's model: each micro-batch of m samples of bucket
    b at degree k takes t(b, k, m)."""
    ctx, worst = p.ctx, 0.0
    for g in plan.groups:
        load = 0.0
        for mb in g.micro_batches:
            b = ctx.bucket_of[mb.sample_ids[0]]
            assert all(ctx.bucket_of[i] == b for i in mb.sample_ids), "a micro-batch holds one bucket"
            load += dict(p._options(b, len(g.ranks), len(mb.sample_ids)))[len(mb.sample_ids)]
        worst = max(worst, load)
    return worst


def _exhaustive(p: FlexSPPlanner, counts: dict) -> float:
    """The least makespan over every set of groups (chain sizes summing to at most the world),
    every split of each bucket's samples among them, and each group's best cut of its share
    into micro-batches of the allowed sizes."""
    ctx, world = p.ctx, p.world
    buckets = sorted(counts)

    @cache
    def cut(b, k: int, n: int) -> float:  # fewest seconds for n samples of b on one group of k
        if n == 0:
            return 0.0
        opts = p._options(b, k, counts[b])
        return min((t + cut(b, k, n - m) for m, t in opts if m <= n), default=math.inf)

    def configs(room: int, smallest: int):  # multisets of chain sizes, largest first
        for k in sorted(ctx.sp_sizes, reverse=True):
            if smallest <= k <= room:
                yield (k,)
                for rest in configs(room - k, 0):
                    if rest[0] <= k:
                        yield (k, *rest)

    def splits(n: int, parts: int):
        for cuts in itertools.combinations(range(n + parts - 1), parts - 1):
            bounds = (-1, *cuts, n + parts - 1)
            yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(parts))

    best = math.inf
    for groups in set(configs(world, 1)):
        for shares in itertools.product(*(list(splits(counts[b], len(groups))) for b in buckets)):
            span = max(sum(cut(b, k, share[g]) for b, share in zip(buckets, shares)) for g, k in enumerate(groups))
            best = min(best, span)
    return best


@pytest.mark.parametrize(
    "model,sizes,world",
    [
        (TINY_LM, (9000, 8000, 7000, 300, 280, 250), 4),
        (TINY_LM, (30_000, 2000, 1900, 120, 110, 100, 90), 4),
        (TINY_DIT, ((34, 128, 128),) * 3 + ((17, 64, 64),) * 3, 4),
        (TINY_DIT, ((68, 256, 256),) * 2 + ((1, 128, 128),) * 4, 2),
    ],
)
def test_the_programs_optimum_equals_an_exhaustive_search(model, sizes, world):
    cl = cluster(world, 4)
    ctx = PlanContext(Workload(model, sizes), cost(model, cl), cl)
    p = FlexSPPlanner(ctx)
    step = Step(0, tuple(range(len(sizes))))
    plan = p.plan(step)
    assert p.outcomes == {"optimal": 1}
    counts: dict = {}
    for i in step.sample_ids:
        counts[ctx.bucket_of[i]] = counts.get(ctx.bucket_of[i], 0) + 1
    assert len(counts) >= 2, "the case mixes buckets"
    best = _exhaustive(p, counts)
    assert _class_makespan(p, plan) == pytest.approx(best, rel=1e-4)


def test_lossless_tiling_and_within_memory_on_mixed_workloads():
    text = tuple([64, 300, 2000, 9000, 30_000, 120, 5000] * 3)
    _check(TINY_LM, text, cluster(8, 4), 0, ["flexsp"])
    video = ((1, 64, 64), (17, 64, 64), (34, 128, 128), (51, 128, 224), (68, 256, 256)) * 4
    _check(TINY_DIT, video, cluster(4, 4), 1, ["flexsp"])


def test_the_same_step_gets_the_same_plan_from_a_fresh_planner():
    sizes = tuple([64, 300, 2000, 9000, 30_000, 120, 5000] * 3)
    cl = cluster(8, 4)
    w = Workload(TINY_LM, sizes)
    steps = form_steps(w.tokens, seed=0, tokens_per_step=sum(w.tokens) // 3)
    got = [[FlexSPPlanner(PlanContext(w, cost(TINY_LM, cl), cl)).plan(s).groups for s in steps] for _ in range(2)]
    assert got[0] == got[1]


def test_without_a_solution_the_fallback_plans_every_sample(monkeypatch):
    sizes = tuple([64, 300, 2000, 9000, 30_000, 120, 5000] * 3)
    cl = cluster(8, 4)
    w = Workload(TINY_LM, sizes)
    ctx = PlanContext(w, cost(TINY_LM, cl), cl)
    p = FlexSPPlanner(ctx)
    monkeypatch.setattr(p, "_solve", lambda buckets, counts: None)
    step = Step(0, tuple(range(len(sizes))))
    plan = p.plan(step)
    plan.validate(8)
    assert sorted(i for mb in plan.micro_batches() for i in mb.sample_ids) == list(range(len(sizes)))
    assert simulate([plan], ctx).memory_violations == 0
    assert p.outcomes == {"fallback": 1} and p.describe()["outcomes"] == {"fallback": 1}
    assert step_seconds(ctx)(plan) > 0


@st.composite
def small_workloads(draw):
    """Worlds 1..8 (any GPUs per node), up to 12 samples of text or video: where the program
    solves in well under a second."""
    g = draw(st.sampled_from([1, 2, 4, 8]))
    world = draw(st.integers(1, 8))
    if world > g:
        world -= world % g
    model, sizes = draw_samples(draw, st, draw(st.integers(1, 12)))
    return model, sizes, cluster(world, g), draw(st.integers(0, 3))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_workloads())
def test_lossless_tiling_and_within_memory_on_random_small_steps(case):
    _check(*case, ["flexsp"])


def test_a_cluster_above_its_reach_is_refused_with_the_limit_named():
    cl = cluster(128, 8)
    ctx = PlanContext(Workload(TINY_LM, (100, 200)), cost(TINY_LM, cl), cl)
    with pytest.raises(ValueError, match="at most 64 GPUs"):
        FlexSPPlanner(ctx)


def test_solver_prints_go_to_stderr_and_stdout_keeps_only_python_output():
    """HiGHS may print from C inside a solve; within `c_stdout_to_stderr` such prints (C's
    buffered printf and raw writes to fd 1) reach stderr, and stdout holds only what Python
    printed before and after (a piped stdout: C buffers it fully, so the flush matters)."""
    import os
    import subprocess
    import sys

    code = (
        "import ctypes, os\n"
        "from dcparallel.plan.research.flexsp import c_stdout_to_stderr\n"
        "print('before')\n"
        "with c_stdout_to_stderr():\n"
        "    ctypes.CDLL(None).printf(b'from C printf\\n')\n"
        "    os.write(1, b'raw fd 1\\n')\n"
        "print('after')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # which unbuffers C's stdout too
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "before\nafter\n"
    assert "from C printf" in r.stderr and "raw fd 1" in r.stderr


def test_a_training_run_plans_under_a_node_limit_alone_never_a_wall_clock(monkeypatch):
    """Every rank solves each step's program on its own: a wall-clock limit would let a busy
    rank stop earlier than the others with another solution (another plan, a hang). The
    policy's planner passes HiGHS a node limit and no time limit."""
    import scipy.optimize

    seen = []
    real = scipy.optimize.milp

    def milp(*args, options=None, **kw):
        seen.append(dict(options or {}))
        return real(*args, options=options, **kw)

    monkeypatch.setattr(scipy.optimize, "milp", milp)
    sizes = (64, 300, 2000, 9000, 120, 5000)
    cl = cluster(8, 4)
    w = Workload(TINY_LM, sizes)
    ctx = PlanContext(w, cost(TINY_LM, cl), cl)
    planner = make_planner("flexsp", ctx, [Step(0, tuple(range(len(sizes))))], score=step_seconds(ctx))
    planner.plan(Step(0, tuple(range(len(sizes)))))
    assert seen and all("time_limit" not in o and o["node_limit"] == NODE_LIMIT for o in seen), seen
    assert planner.describe()["time_limit_s"] is None
