"""The simulator replays plans exactly as the cost model prices them."""

import pytest

from dcparallel.cost.overlap import exposed_sync, num_buckets
from dcparallel.plan.context import PlanContext
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.sim.replay import simulate
from dcparallel.spec import Layout, Recompute, Workload

from ._models import TINY_LM, cluster, cost


def test_step_time_idle_and_timeline_by_hand():
    cl = cluster(4, 4)
    c = cost(TINY_LM, cl)
    w = Workload(TINY_LM, (4000, 1000, 1000, 8000))
    ctx = PlanContext(w, c, cl)
    plan = StepPlan(
        0,
        (0, 1, 2, 3),
        (
            GroupPlan((0, 1), (MicroBatch((3,), Layout(2, 1)),)),
            GroupPlan((2,), (MicroBatch((0,), Layout(1, 1)), MicroBatch((1, 2), Layout(1, 2)))),
            GroupPlan((3,), ()),
        ),
        num_tokens=14000,
    )
    t_long = ctx.mb_time((3,), Layout(2, 1))
    t_a, t_b = ctx.mb_time((0,), Layout(1, 1)), ctx.mb_time((1, 2), Layout(1, 2))
    res = simulate([plan], ctx, overlap=False)
    step = res.steps[0]
    assert step.compute_time == pytest.approx(max(t_long, t_a + t_b))
    assert step.step_time == pytest.approx(step.compute_time + c.grad_sync_time())
    # overlapped sync: the last backward of the group that finishes last hides part of it
    hidden = simulate([plan], ctx).steps[0]
    last_mb = t_long if t_long >= t_a + t_b else t_b
    s = c.grad_sync_time()
    assert hidden.sync_time == pytest.approx(max(s - 2 / 3 * last_mb, s / num_buckets(TINY_LM.num_params)))
    assert hidden.compute_time == step.compute_time and hidden.sync_time <= s  # tiny model: one bucket
    expected_idle = 2 * (step.compute_time - t_long) + (step.compute_time - t_a - t_b) + step.compute_time
    assert step.idle_gpu_s == pytest.approx(expected_idle)
    assert res.idle_fraction == pytest.approx(expected_idle / (4 * res.total_time))
    assert res.tokens_per_s == pytest.approx(14000 / res.total_time)
    # rank 3 ran nothing: idle the whole compute phase, then the sync
    tl = res.rank_timeline(3)
    assert [k for _, _, k in tl] == ["idle", "sync"]
    assert res.rank_timeline(2)[1][0] == pytest.approx(t_a)  # second micro-batch starts after the first


def test_a_plan_that_loses_or_repeats_a_sample_is_refused():
    """`simulate` refuses a plan whose micro-batches leave a step sample out, plan one twice or
    hold one from outside the step, naming them; the plan that holds each once replays."""
    cl = cluster(4, 4)
    ctx = PlanContext(Workload(TINY_LM, (4000, 1000, 1000, 8000, 500)), cost(TINY_LM, cl), cl)

    def plan(*mbs):
        groups = tuple(
            GroupPlan((r,), (MicroBatch(ids, Layout(1, len(ids))),) if ids else ()) for r, ids in enumerate(mbs)
        )
        return StepPlan(3, (0, 1, 2, 3), groups, num_tokens=14000)

    assert len(simulate([plan((0,), (1, 2), (3,), ())], ctx).steps) == 1
    with pytest.raises(ValueError, match=r"step 3: .* 1 left out \[2\], 0 planned more than once"):
        simulate([plan((0,), (1,), (3,), ())], ctx)
    with pytest.raises(ValueError, match=r"0 left out \[\], 1 planned more than once \[1\]"):
        simulate([plan((0,), (1, 2), (3,), (1,))], ctx)
    with pytest.raises(ValueError, match=r"1 not in the step \[4\]"):
        simulate([plan((0,), (1, 2), (3,), (4,))], ctx)


def test_over_memory_plan_is_flagged():
    cl = cluster(1, 1, memory_mib=64)
    w = Workload(TINY_LM, (100, 3000))
    ctx = PlanContext(w, cost(TINY_LM, cl), cl, skip_oversize=True)
    plan = StepPlan(0, (1,), (GroupPlan((0,), (MicroBatch((1,), Layout(1, 1)),)),), 3000)
    assert ctx.mb_memory((1,), Layout(1, 1)) > ctx.budget
    assert simulate([plan], ctx).memory_violations == 1


def test_two_phase_step_waits_per_group_not_per_phase():
    """Phase 1 groups start when *their* ranks are done with phase 0: rank 2 (idle in phase
    0) starts at once, the pair (0, 1) waits for the slower of its two phase-0 groups."""
    cl = cluster(4, 4)
    c = cost(TINY_LM, cl)
    ctx = PlanContext(Workload(TINY_LM, (8000, 1000, 3000, 500, 2000)), c, cl)
    plan = StepPlan(
        0,
        (0, 1, 2, 3, 4),
        (
            GroupPlan((0,), (MicroBatch((0,), Layout(1, 1)),)),
            GroupPlan((1,), (MicroBatch((1,), Layout(1, 1)),)),
            GroupPlan((2, 3), ()),
            GroupPlan((0, 1), (MicroBatch((2,), Layout(2, 1, Recompute(4, 0))),), phase=1),
            GroupPlan((2,), (MicroBatch((3,), Layout(1, 1)),), phase=1),
            GroupPlan((3,), (MicroBatch((4,), Layout(1, 1)),), phase=1),
        ),
        num_tokens=14500,
    )
    plan.validate(4)
    t = {i: ctx.mb_time((i,), Layout(1, 1)) for i in (0, 1, 3, 4)}
    t2 = ctx.mb_time((2,), Layout(2, 1, Recompute(4, 0)))
    assert t[0] > t[1]
    step = simulate([plan], ctx).steps[0]
    end = max(t[0] + t2, t[3], t[4])
    assert step.compute_time == pytest.approx(end)
    busy = {0: t[0] + t2, 1: t[1] + t2, 2: t[3], 3: t[4]}
    assert step.idle_gpu_s == pytest.approx(sum(end - b for b in busy.values()))
    res = simulate([plan], ctx)
    # rank 1 waits for rank 0 between its phase-0 and phase-1 micro-batches
    assert [k for _, _, k in res.rank_timeline(1)] == ["busy sp=1", "idle", "busy sp=2 recompute", "sync"]
    assert res.rank_timeline(1)[2][0] == pytest.approx(t[0])
    assert res.rank_timeline(2)[0][:2] == pytest.approx((0.0, t[3]))


def test_phases_must_each_tile_the_world():
    ok = GroupPlan((0, 1), (MicroBatch((0,), Layout(2, 1)),))
    plan = StepPlan(0, (0, 1), (ok, GroupPlan((0,), (MicroBatch((1,), Layout(1, 1)),), phase=1)), 2)
    with pytest.raises(AssertionError, match="phase 1's groups do not tile the world"):
        plan.validate(2)
    wide = GroupPlan((0, 1), (MicroBatch((0,), Layout(2, 1)),))
    unordered = StepPlan(0, (0,), (GroupPlan((0, 1), (), phase=1), wide), 1)
    with pytest.raises(AssertionError, match="not in phase order"):
        unordered.validate(2)


def test_exposed_sync_is_what_the_last_backward_cannot_hide():
    assert exposed_sync(1.0, 0.0, 10) == 1.0  # nothing to hide behind (an idle critical rank)
    assert exposed_sync(1.0, 0.9, 10) == pytest.approx(0.4)  # 2/3 of 0.9 s is backward
    assert exposed_sync(1.0, 30.0, 10) == pytest.approx(0.1)  # the last bucket is always exposed
    assert exposed_sync(0.0, 1.0, 10) == 0.0
    assert num_buckets(7e9) == 1069  # ceil(28e9 B / 25 MiB): 28 GB of fp32 gradients in 25 MiB buckets


@pytest.mark.parametrize(("scenario", "mix"), [("text", "long-cpt"), ("video", "video-mix")])
def test_the_score_is_the_replays_step_time_to_the_bit(scenario, mix):
    """`step_seconds` (planners' score, which builds no segments) equals `replay_step`'s step
    time exactly, on the plans `dcp` makes at 256 GPUs (on long-cpt: the per-sample packing's
    sub-groups and phases) and on `bucket`'s, with and without the overlapped sync."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.plan.policies import make_planner
    from dcparallel.plan.steps import form_steps
    from dcparallel.scenarios import SCENARIOS, sample_sizes
    from dcparallel.sim.replay import replay_step, step_seconds

    sc = SCENARIOS[scenario]
    tps = sc.tokens_per_step * 256 // 32
    wl = Workload(sc.model, tuple(sample_sizes(scenario, mix, epoch_tokens=2 * tps)))
    cl = sc.cluster(256)
    ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
    step = form_steps(wl.tokens, seed=0, tokens_per_step=tps)[0]
    plans = [make_planner(p, ctx, [step], score=step_seconds(ctx)).plan(step) for p in ("dcp", "bucket")]
    assert max(len({g.phase for g in p.groups}) for p in plans) > (scenario == "text")  # phases met
    for plan in plans:
        for overlap in (True, False):
            assert step_seconds(ctx, overlap)(plan) == replay_step(plan, ctx, overlap).step_time
