"""The class-based `dcp` planner: lossless, tiling, within memory and identical when planned
twice from scratch (what independent ranks do) — property tests over worlds 1..4096 —
plus the class dealing and the few-samples-per-GPU regime."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.classes import class_span as _span
from dcparallel.plan.dcp.classes import deal_classes
from dcparallel.plan.dcp.classlevel import ClassLevelPlanner
from dcparallel.plan.dcp.portfolio import DcpPlanner, FinerClasses
from dcparallel.plan.dcp.tables import LayoutTable
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.sim.replay import simulate, step_seconds
from dcparallel.spec import Workload
from dcparallel.topology import allowed_groups

from ._models import TINY_DIT, TINY_LM, check_dcp_epoch, cluster, cost, draw_samples


@st.composite
def big_workloads(draw):
    world = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 24, 64, 256, 1024, 4096]))
    g = 8 if world >= 8 else world
    n = draw(st.integers(1, 120))
    model, sizes = draw_samples(draw, st, n)
    steps_per_epoch = draw(st.integers(1, 3))
    return model, sizes, cluster(world, g), draw(st.integers(0, 3)), steps_per_epoch


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(big_workloads())
def test_dcp_lossless_tiling_memory_and_identical_across_ranks(case):
    check_dcp_epoch(*case)


def test_a_mixed_micro_batch_does_not_beat_the_bound():
    """The case Hypothesis found: one rank, a long sample of which two copies fit, two short
    ones; `dcp` keeps `packed`'s one micro-batch of all three, which amortizes the long one's
    launch floor over the short ones' work. The bound prices each sample at what it adds to
    any mix (`plan.mix_share`), not at its copies' fewest GPU-seconds, and stays below it."""
    w = Workload(TINY_LM, (2473, 2568, 27825))
    cl = cluster(1, 1)
    steps = form_steps(w.tokens, seed=0, tokens_per_step=sum(w.tokens))
    ctx = PlanContext(w, cost(TINY_LM, cl), cl)
    plans = [make_planner("dcp", ctx, steps, score=step_seconds(ctx)).plan(s) for s in steps]
    assert simulate(plans, ctx).total_time >= LowerBound(ctx).epoch(steps) * (1 - 1e-9)


def test_deal_classes_counts_and_lpt_loads():
    items = [(0, 3.0, 5), (1, 1.0, 7)]  # 15 + 7 = 22 seconds of work on 4 groups
    classes = deal_classes(items, 4)
    assert sum(c.count for c in classes) == 4
    for ic, _, q in items:
        assert sum(c.count * c.items.get(ic, 0) for c in classes) == q
    loads = sorted(load for c in classes for load in [c.load] * c.count)
    assert sum(loads) == 22.0
    assert max(loads) == 6.0 == _span(items, 4)  # 3+3 on one group; the rest fill up to 6 or less


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 0.7]), st.integers(1, 40)), min_size=1, max_size=30),
    st.integers(1, 64),
)
def test_dealt_classes_conserve_work_match_the_span_and_are_merged(pairs, n):
    """Whole-class LPT on many item classes (equal times make equal loads, the case where
    group classes merge): every micro-batch dealt once, the makespan `class_span` predicts, and
    no two group classes alike (same load, same contents) are left apart."""
    items = [(ic, t, q) for ic, (t, q) in enumerate(pairs)]
    classes = deal_classes(items, n)
    assert sum(c.count for c in classes) == n and all(c.count > 0 for c in classes)
    for ic, _, q in items:
        assert sum(c.count * c.items.get(ic, 0) for c in classes) == q
    for c in classes:
        assert abs(c.load - sum(items[ic][1] * k for ic, k in c.items.items())) < 1e-9
    # the same makespan up to rounding: class_span adds onto merged loads, deal_classes onto each class's
    span = _span(items, n)
    assert abs(max(c.load for c in classes) - span) <= 1e-12 * span
    keys = [(c.load, tuple(sorted((ic, k) for ic, k in c.items.items() if k))) for c in classes]
    assert len(set(keys)) == len(keys)


def test_few_samples_per_gpu_widens_sp_and_beats_a_narrow_layout():
    """Four mid-length samples on 16 ranks: at their cheapest layout (SP 1) twelve ranks idle;
    dcp widens them and finishes the step sooner than the narrow plan would."""
    cl = cluster(16, 8)
    w = Workload(TINY_LM, (20_000, 21_000, 22_000, 23_000))
    ctx = PlanContext(w, cost(TINY_LM, cl), cl)
    steps = form_steps(w.tokens, seed=0, samples_per_step=4)
    plan = make_planner("dcp", ctx, steps, score=step_seconds(ctx)).plan(steps[0])
    assert max(m.layout.sp for m in plan.micro_batches()) > 1
    narrow = make_planner("dcp-intra", ctx, steps, score=step_seconds(ctx)).plan(steps[0])
    t = simulate([plan], ctx).steps[0].compute_time
    t_narrow = simulate([narrow], ctx).steps[0].compute_time
    assert t < t_narrow
    assert t >= LowerBound(ctx).step(steps[0]) - ctx.cost.grad_sync_time() - 1e-12


def test_weights_stay_within_a_class():
    cl = cluster(8, 8)
    w = Workload(TINY_LM, (1000, 1100, 1200, 5000, 6000))
    ctx = PlanContext(w, cost(TINY_LM, cl), cl)
    p = LayoutTable(ctx)
    assert all(0 < x <= 1.0 for x in p.weight)


def test_peer_reproductions_are_lossless_and_within_memory():
    from tests.unit.test_policies import _check

    sizes = tuple([64, 300, 2000, 9000, 30_000, 120, 5000] * 6)
    times = _check(TINY_LM, sizes, cluster(8, 4), 0, ["megatron-dcp", "hbp"])
    assert set(times) == {"megatron-dcp", "hbp"}


@st.composite
def few_per_gpu_text(draw):
    """Text steps with at most two samples per GPU on large worlds: the regime where `dcp` also
    plans over finer length classes (`portfolio.FinerClasses`)."""
    world = draw(st.sampled_from([128, 512, 1024, 2048, 4096]))
    n = draw(st.integers(1, 100))
    sizes = tuple(draw(st.lists(st.integers(16, 40_000), min_size=n, max_size=n)))
    return sizes, cluster(world, 8), draw(st.integers(0, 3))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(few_per_gpu_text())
def test_finer_classes_are_lossless_and_identical_from_scratch(case):
    sizes, cl, seed = case
    w = Workload(TINY_LM, sizes)
    steps = form_steps(w.tokens, seed=seed, tokens_per_step=max(1, sum(w.tokens) // 2))
    allowed = set(allowed_groups(cl, TINY_LM.num_heads))
    got = []
    for _ in range(2):
        ctx = PlanContext(w, cost(TINY_LM, cl), cl)
        p = ClassLevelPlanner(LayoutTable(ctx, sub_bins=4))  # the finer-classes candidate
        assert p.table.sub_bins == 4
        got.append([p.class_plan(s).plan for s in steps])
    assert [x.to_json() for x in got[0]] == [x.to_json() for x in got[1]]
    for plan, s in zip(got[0], steps):
        plan.validate(cl.world_size, allowed)
        assert sorted(i for mb in plan.micro_batches() for i in mb.sample_ids) == sorted(s.sample_ids)
    assert simulate(got[0], ctx).memory_violations == 0


def test_finer_classes_split_a_bucket_by_length_and_fit_their_largest_sample():
    cl = cluster(1024, 8)
    w = Workload(TINY_LM, (15_000, 16_000, 16_500, 18_000))  # one cost bucket: [1.25 ** 43, 1.25 ** 44)
    ctx = PlanContext(w, cost(TINY_LM, cl), cl)
    dcp, fine = DcpPlanner(ctx, step_seconds(ctx)), LayoutTable(ctx, sub_bins=4)
    assert len(dcp.class_level[0].table.pclasses) == 1 and any(isinstance(c, FinerClasses) for c in dcp.class_level)
    assert len(fine.pclasses) == 2  # 2 ** (1 / 4) length ranges: 15000, 16000 | 16500, 18000 (split at 2 ** 14)
    assert fine.bidx.tolist() == [0, 0, 1, 1]
    for i, j in enumerate(fine.bidx.tolist()):
        assert ctx.model.tokens(fine.rep[fine.pclasses[j]]) >= w.tokens[i]


def plan_hash() -> str:
    """sha256 of `dcp`'s plans (text on 4096 GPUs, video on 512) and of the per-sample packing."""
    import hashlib
    import json

    from dcparallel.plan.dcp.sample import SamplePacker

    shapes = [(1, 64, 64), (17, 64, 64), (34, 128, 128), (68, 256, 256)]
    out = []
    for world, model in ((4096, TINY_LM), (512, TINY_DIT)):
        sizes = tuple(shapes[i % 4] if model is TINY_DIT else 16 + (i * 7919) % 40_000 for i in range(240))
        w, cl = Workload(model, sizes), cluster(world, 8)
        steps = form_steps(w.tokens, seed=1, tokens_per_step=sum(w.tokens) // 3)
        ctx = PlanContext(w, cost(model, cl), cl)
        p = make_planner("dcp", ctx, steps, score=step_seconds(ctx))
        out.append([p.plan(s).to_json() for s in steps])
        packer = SamplePacker(ctx, "pac")  # the per-sample packing, whether or not dcp keeps it here
        out.append([packer.step_plan(s, packer.plan(list(s.sample_ids))[0]).to_json() for s in steps])
    return hashlib.sha256(json.dumps(out).encode()).hexdigest()


def test_same_plans_in_other_processes_with_other_hash_seeds():
    """Ranks plan independently, each in its own process (string hashing differs between
    processes): the plans must be identical (text on 4096 GPUs, video on 512)."""
    from ._hash_seed import run_with_other_hash_seed

    here = plan_hash()
    assert len(here) == 64
    assert run_with_other_hash_seed("from tests.unit.test_dcp_scale import plan_hash; print(plan_hash())") == here
