"""`dcp`'s per-sample packing (`plan.dcp.sample`), used for steps with few samples per GPU:
lossless, tiling, within memory, identical from scratch, its prediction the simulator's, and
chosen by `dcp` where it beats the class-level plan."""

import dataclasses
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.tight_bound import build_cell
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.candidate import StepFacts
from dcparallel.plan.dcp.config import DEFAULT
from dcparallel.plan.dcp.packing import Node
from dcparallel.plan.dcp.portfolio import DcpPlanner
from dcparallel.plan.dcp.sample import SamplePacker
from dcparallel.plan.dcp.tables import least_gpu_seconds_within
from dcparallel.plan.steps import form_steps
from dcparallel.plan.types import MIN_GAIN
from dcparallel.scenarios import EPOCH_STEPS, SCENARIOS, sample_sizes
from dcparallel.sim.replay import replay_step, step_seconds
from dcparallel.spec import Workload
from dcparallel.topology import allowed_groups

from ._models import TINY_LM, cluster, cost, draw_samples


@st.composite
def few_per_gpu(draw):
    world = draw(st.sampled_from([1, 4, 24, 128, 512, 1024, 4096]))
    n = draw(st.integers(1, 80))
    model, sizes = draw_samples(draw, st, n)
    return model, sizes, cluster(world, min(8, world)), draw(st.integers(0, 3))


def _items(groups):
    for _, _, items, kids in groups:
        yield from items
        yield from _items(kids)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(few_per_gpu())
def test_packing_is_lossless_tiles_fits_and_predicts_the_simulator(case):
    model, sizes, cl, seed = case
    w = Workload(model, sizes)
    steps = form_steps(w.tokens, seed=seed, tokens_per_step=max(1, sum(w.tokens) // 2))
    allowed = set(allowed_groups(cl, model.num_heads))
    got = []
    for _ in range(2):  # two "ranks", each from scratch
        ctx = PlanContext(w, cost(model, cl), cl)
        packer = SamplePacker(ctx, "pac")
        got.append([(s, packer.plan(list(s.sample_ids))) for s in steps])
    assert [g for _, g in got[0]] == [g for _, g in got[1]]
    lb = LowerBound(ctx)
    for s, (groups, span) in got[0]:
        assert sorted(i for item in _items(groups) for i in item) == sorted(s.sample_ids)
        assert sum(g[0] for g in groups) <= cl.world_size
        priced: list[float] = []
        plan = packer.step_plan(s, groups, priced)
        plan.validate(cl.world_size, allowed)
        mbs = [mb for g in plan.groups for mb in g.micro_batches]
        assert priced == [ctx.mb_time(mb.sample_ids, mb.layout) for mb in mbs]  # as priced, to the bit
        assert step_seconds(ctx).priced(plan, priced) == step_seconds(ctx)(plan)
        r = replay_step(plan, ctx)
        assert r.memory_violations == 0
        assert abs(r.step_time - span) <= 1e-9 * span  # the packer predicts exactly what is simulated
        assert r.step_time >= lb.step(s) * (1 - 1e-9)
        last = plan.num_phases - 1
        top = [g for g in plan.groups if g.phase == last]  # the top-level groups run last
        for g, (k, _, ids, _) in zip(top, groups):  # longest last: it hides the sync
            times = [ctx.mb_time(mb.sample_ids, mb.layout) for mb in g.micro_batches]
            assert times == sorted(times) and len(g.ranks) == k
            assert [mb.sample_ids for mb in g.micro_batches] == ids


def test_dcp_packs_sample_by_sample_when_few_samples_per_gpu_beat_the_classes():
    """The text scenario's long-context mix (7B model, H200 calibration) at 0.375 samples per
    GPU on 256 GPUs: the class-level plan times every sample of a class as its largest;
    packing them one by one finishes sooner, and `dcp` keeps the faster plan. Asked to beat a
    time, the packing returns its plan only if faster."""
    sc = SCENARIOS["text"]
    cl = sc.cluster(256)
    sizes = tuple(sample_sizes("text", "long", epoch_tokens=sc.tokens_per_step * 4))[:96]
    w = Workload(sc.model, sizes)
    ctx = PlanContext(w, AnalyticCost(sc.model, cl), cl)
    step = form_steps(w.tokens, seed=0, samples_per_step=96)[0]
    p = DcpPlanner(ctx, step_seconds(ctx))
    class_plan = p.class_level[0].class_plan(step).plan
    packed, span = p.packer.plan(list(step.sample_ids))
    chosen = p.plan(step)
    t = p.score
    assert span < t(class_plan) * 0.9, (span, t(class_plan))  # 3.69 s against 4.69 s when written
    assert t(chosen) <= min(t(class_plan), span) * (1 + 1e-9)
    assert chosen.to_json() == p.packer.step_plan(step, packed).to_json()  # the packed plan was kept
    # asked only for plans faster than another, it finds the same one, or none if it is not faster
    assert p.packer.plan(list(step.sample_ids), beat=lambda: span * 1.01)[1] == span
    assert p.packer.plan(list(step.sample_ids), beat=lambda: span) is None


def test_wide_groups_split_into_sub_groups_for_short_samples():
    """The scale report's strong 512-GPU text/short cell, step 0 (884 samples, 0.4-122k
    tokens): a group that runs a long sample at SP 32 has time left that short samples fill
    at their own narrow degree, as sub-groups on its ranks in an earlier phase. The plan is
    lossless, tiles every phase, nests each sub-group inside its parents' blocks, predicts
    exactly what the simulator replays, and finishes sooner than packing without sub-groups."""
    sc = SCENARIOS["text"]
    cl = sc.cluster(512)
    w = Workload(sc.model, tuple(sample_sizes("text", "short", epoch_tokens=EPOCH_STEPS * sc.tokens_per_step)))
    ctx = PlanContext(w, AnalyticCost(sc.model, cl), cl)
    step = form_steps(w.tokens, seed=0, tokens_per_step=sc.tokens_per_step)[0]
    packer = SamplePacker(ctx, "pac")
    groups, span = packer.plan(list(step.sample_ids))
    plan = packer.step_plan(step, groups)
    plan.validate(cl.world_size, set(allowed_groups(cl, sc.model.num_heads)))
    assert sorted(i for item in _items(groups) for i in item) == sorted(step.sample_ids)
    r = replay_step(plan, ctx)
    assert r.memory_violations == 0 and abs(r.step_time - span) <= 1e-9 * span
    assert plan.num_phases >= 2
    busy = [g for g in plan.groups if g.micro_batches]
    last = plan.num_phases - 1
    for g in busy:  # blocks nest: a group overlaps only its sub-groups (earlier) and its parents (later)
        later = [h for h in busy if h.phase > g.phase and set(g.ranks) & set(h.ranks)]
        assert all(set(g.ranks) < set(h.ranks) for h in later)
        assert later or g.phase == last  # a sub-group runs before a wider group
    ways = packer.ways(list(step.sample_ids))  # one per sample, preferred sizes, and finer runs
    assert len(ways) == 2 + len(packer.config.pack_splits)
    spans = [
        packer._plan_items(w, packer.times(w), by_time, open_first)[1]
        for w in ways
        for by_time, open_first in ((False, False), (True, False), (False, True))
    ]
    assert span == min(spans) and len(set(spans)) > 1  # the fastest of ways that differ
    packer = FlatPacker(packer.ctx, packer.mode)
    flat, flat_span = packer.plan(list(step.sample_ids))
    assert packer.step_plan(step, flat).num_phases == 1
    assert span < flat_span * 0.995, (span, flat_span)  # 1.930 s against 2.008 s when written


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1.0, 100.0), min_size=1, max_size=40), st.floats(0.5, 150.0), st.floats(0.01, 0.99))
def test_target_search_finds_the_smallest_target_that_packs(finishes, first, below):
    """Where packing at T succeeds exactly from some T* on (monotone), `search_targets` returns
    T* if it is a micro-batch's finish, else a target at most `continuous_gap` above it (or, where
    its last bisection starts from a step up to 8x wide, 8 x 2^-`continuous_steps`), and first
    the smallest finish at or above T* (or its own step above the floor); it never returns a
    target that does not pack, and asks for none below the floor."""
    from dcparallel.plan.dcp.config import DEFAULT
    from dcparallel.plan.dcp.targets import search_targets

    f = np.array(finishes + [np.inf])
    floor = min(first, max(finishes)) * below
    asked = []

    def pack(T):
        asked.append(T)
        return True if T >= first else None

    got = search_targets(pack, f, floor)
    assert got and all(T >= first for T in got)
    assert min(asked) >= floor * (1 - 1e-9)
    assert (
        min(got) <= first * (1 + max(DEFAULT.continuous_gap, 8 * 2.0**-DEFAULT.continuous_steps))
        or min(got) in finishes
    )
    at_or_above = [x for x in finishes if x >= first]
    if at_or_above and got[0] not in at_or_above:
        assert got[0] <= min(at_or_above)  # a step of the search, below the next finish


class FlatPacker(SamplePacker):
    """The per-sample packing without sub-groups: no wider group splits for a narrower
    micro-batch."""

    def split_degrees(self, d: int) -> range:
        return range(0)


def _packer(world: int) -> SamplePacker:
    cl = cluster(world, min(8, world))
    return SamplePacker(PlanContext(Workload(TINY_LM, (64,)), cost(TINY_LM, cl), cl), "pac")


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([4, 8, 16]),
    st.lists(st.tuples(st.floats(0.5, 40.0), st.floats(0.5, 1.0)), min_size=1, max_size=24),
    st.floats(1.0, 60.0),
)
def test_ranks_short_only_where_no_packing_fits_the_world(world, rows, T):
    """`ranks_short` is a necessary condition: where it says the world is short at T, no way
    of packing (every order, with sub-groups or without) fits at T, and it says so at every
    smaller target too."""
    packer = _packer(world)
    # each micro-batch r times faster per doubling of its degree (r >= 1/2: communication)
    t = np.array([[b * r**j for j in range(len(packer.sp))] for b, r in rows])
    f = packer.alone(t)
    if not packer.ranks_short(t, f, T):
        return
    assert packer.ranks_short(t, f, T * 0.7)
    for each in (packer, FlatPacker(packer.ctx, packer.mode)):
        for by_time, open_first in ((False, False), (True, False), (False, True)):
            assert each.pack(list(range(len(rows))), t, f, T, by_time, open_first) is None


class UncheckedPacker(SamplePacker):
    """The per-sample packing without its GPU-seconds test: every target packed in full."""

    def too_much_work(self, t, gpu_s, nar, cap) -> bool:
        return False


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([4, 8, 16]),
    st.lists(st.tuples(st.floats(0.5, 40.0), st.floats(0.5, 1.0)), min_size=2, max_size=30),
    st.floats(0.9, 1.3),
    st.booleans(),
    st.booleans(),
)
def test_too_much_work_only_where_packing_fails(world, rows, above, by_time, open_first):
    """`too_much_work` (the micro-batches' least GPU-seconds at the degrees `pack` may give
    them above world x target) is a necessary condition: where it holds, the packing in full
    fails too; `pack` with it returns what the packing in full returns. Targets near the
    GPU-seconds floor, where it decides."""
    packer = _packer(world)
    t = np.array([[b * r**j for j in range(len(packer.sp))] for b, r in rows])
    f, ids = packer.alone(t), list(range(len(rows)))
    T = max(f.min(axis=1).max(), (t * packer.kf).min(axis=1).sum() / world) * above
    full = UncheckedPacker(packer.ctx, packer.mode).pack(ids, t, f, T, by_time, open_first)
    assert packer.pack(ids, t, f, T, by_time, open_first) == full
    cap = T * (1 + 1e-12)
    if (f <= cap).any(axis=1).all():
        nar = least_gpu_seconds_within(t * packer.kf, f, cap)
        assert not packer.too_much_work(t, t * packer.kf, nar, cap) or full is None


def _weak_first_step(scenario: str, dist: str, world: int):
    """A `SamplePacker` on the scenario's analytic model at ``world`` GPUs, and the first weak
    step of ``dist`` (the scenario's 32-GPU budget x world / 32), as the scale report forms it."""
    ctx, steps = build_cell(scenario, dist, world, SCENARIOS[scenario].tokens_per_step * world // 32, 1)
    return SamplePacker(ctx, "pac"), steps[0]


def test_too_much_work_rejects_targets_of_a_real_search():
    """On the micro-batches of a heavy-tail step (weak pretrain-long at 1024 GPUs), the
    search's first target (the GPU-seconds floor less `floor_slack`) fails by `too_much_work`
    before any micro-batch is placed, and the packing in full agrees; above the floor, where
    the packing fits, it does not say so."""
    packer, step = _weak_first_step("text", "pretrain-long", 1024)
    ctx = packer.ctx
    items = packer.items(list(step.sample_ids))
    t = packer.times(items)
    f, ids = packer.alone(t), [it[0] for it in items]
    floor = (t * packer.kf).min(axis=1).sum() / 1024
    assert floor > f.min(axis=1).max()  # the GPU-seconds floor is the floor
    for T, fits in ((floor * (1 - DEFAULT.floor_slack), False), (floor * 1.05, True)):
        cap = T * (1 + 1e-12)
        nar = least_gpu_seconds_within(t * packer.kf, f, cap)
        assert packer.too_much_work(t, t * packer.kf, nar, cap) is not fits
        assert (UncheckedPacker(ctx, "pac").pack(ids, t, f, T, open_first=True) is not None) is fits


def test_a_heavy_tail_step_at_4096_gpus_is_packed_within_the_item_cap():
    """A weak pretrain-long step at 4096 GPUs (118k documents, 21.6k micro-batches of preferred
    size) is within `pack_max_items`: `dcp` keeps the packing's plan, 4.9% faster than the
    class level's, which a cap of 8192 micro-batches leaves it with."""
    packer, step = _weak_first_step("text", "pretrain-long", 4096)
    assert 8192 < len(packer.items(list(step.sample_ids))) <= DEFAULT.pack_max_items
    score = step_seconds(packer.ctx)
    packs = DcpPlanner(packer.ctx, score)
    capped = DcpPlanner(packer.ctx, score, config=dataclasses.replace(DEFAULT, pack_max_items=8192))
    got, alone = score(packs.plan(step)), score(capped.plan(step))
    assert packs.kept_by["packing"] == 1 and capped.kept_by["class level"] == 1
    assert got < alone * 0.97, (got, alone)


def test_ranks_short_on_micro_batches_longer_than_half_the_target():
    """On 8 ranks at target 10: a micro-batch of 14, 7, 5.5, 5.2 s at SP 1, 2, 4, 8 fits from SP 2
    and is longer than 5 wherever it fits, so it holds 2 ranks alone; four of them fit the
    world and pack, five do not (and packing agrees). One within 5 at some degree where it
    fits is not counted, however many there are."""
    packer = _packer(8)
    assert packer.sp == [1, 2, 4, 8]
    long, short = [14.0, 7.0, 5.5, 5.2], [4.0, 2.5, 2.0, 1.8]
    for n, is_short in ((4, False), (5, True)):
        t = np.array([long] * n + [short] * 2)
        f = packer.alone(t)
        assert packer.ranks_short(t, f, 10.0) is is_short
        assert (packer.pack(list(range(len(t))), t, f, 10.0) is None) is is_short
    t = np.array([[10.0, 6.0, 3.5, 3.0]] * 9)  # within 5 at SP 4 and 8
    assert not packer.ranks_short(t, packer.alone(t), 10.0)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([4, 8, 16]),
    st.lists(st.tuples(st.floats(0.5, 40.0), st.floats(0.5, 1.0)), min_size=1, max_size=30),
    st.lists(st.floats(2.0, 80.0), min_size=1, max_size=8),
    st.booleans(),
    st.booleans(),
)
def test_packing_with_a_shared_memo_is_packing_from_scratch(world, rows, targets, by_time, open_first):
    """`pack`'s `memo`, shared by the packings of one search at many targets (in any order),
    changes no packing: each equals the packing at that target with nothing shared."""
    packer = _packer(world)
    t = np.array([[b * r**j for j in range(len(packer.sp))] for b, r in rows])
    f, ids, memo = packer.alone(t), list(range(len(rows))), {}
    for T in targets + targets[::-1]:
        shared = packer.pack(ids, t, f, T, by_time, open_first, memo)
        assert shared == packer.pack(ids, t, f, T, by_time, open_first)


def _record_packings(monkeypatch) -> list[tuple]:
    """Records each packing `SamplePacker.plan` tries: (items, by_time, open_first, ceiling,
    its span or None)."""
    calls, plan_items = [], SamplePacker._plan_items

    def spy(self, items, t, by_time, open_first, ceiling=math.inf):
        got = plan_items(self, items, t, by_time, open_first, ceiling)
        calls.append((items, by_time, open_first, ceiling, None if got is None else got.span))
        return got

    monkeypatch.setattr(SamplePacker, "_plan_items", spy)
    return calls


def test_few_per_gpu_packing_tries_the_finest_runs_first_and_keeps_the_fastest(monkeypatch):
    """A step of about 1.7 samples per GPU (text/balanced lengths, 128 GPUs) is packed every
    way (preferred sizes, one sample each, runs of a half and a third) in each order: new
    groups opened first, then the plain order, then by time; within each, the finest runs
    first. Each seeks only packings faster than the best before it, and the fastest is kept."""
    sc = SCENARIOS["text"]
    cl = sc.cluster(128)
    w = Workload(sc.model, tuple(sample_sizes("text", "balanced", epoch_tokens=sc.tokens_per_step * 4))[:220])
    ctx = PlanContext(w, AnalyticCost(sc.model, cl), cl)
    packer, ids = SamplePacker(ctx, "pac"), list(range(220))
    calls = _record_packings(monkeypatch)
    ways = packer.ways(ids)
    assert len(ways) == 4 and len(ways[0]) < len(ways[-1]) < len(ids)  # preferred sizes coarsest
    got = packer.plan(ids)
    orders = ((False, True), (False, False), (True, False))
    assert [c[:3] for c in calls] == [(items, *o) for o in orders for items in reversed(ways)]
    best = math.inf
    for *_, ceiling, span in calls:
        assert ceiling == best * (1 - MIN_GAIN)
        if span is not None:
            assert span < ceiling
            best = span
    assert got.span == best < math.inf


def test_many_per_gpu_video_packing_tries_the_half_runs_first(monkeypatch):
    """A video step of 11.7 samples per GPU (video/balanced shapes, 128 GPUs) is packed with
    `max_items` in one order (new groups opened first): its runs of a half and a third of the
    preferred size first, preferred sizes last (a preferred video micro-batch holds several
    clips of one shape); each way seeks only packings faster than the best before it."""
    sc = SCENARIOS["video"]
    cl = sc.cluster(128)
    w = Workload(sc.model, tuple(sample_sizes("video", "balanced", epoch_tokens=sc.tokens_per_step * 8))[:1500])
    ctx = PlanContext(w, AnalyticCost(sc.model, cl), cl)
    packer, ids = SamplePacker(ctx, "pac"), list(range(1500))
    calls = _record_packings(monkeypatch)
    ways = packer.ways(ids, DEFAULT.pack_max_items)
    assert len(ways) == 3 and len(ways[0]) < len(ways[1]) < len(ways[2])  # preferred, halves, thirds
    got = packer.plan(ids, DEFAULT.pack_max_items)
    assert [c[:3] for c in calls] == [(items, False, True) for items in (ways[1], ways[2], ways[0])]
    best = math.inf
    for *_, ceiling, span in calls:
        assert ceiling == best * (1 - MIN_GAIN)
        if span is not None:
            best = span
    assert got.span == best < math.inf


def test_a_real_packing_is_scored_from_its_own_prices():
    """On a heavy-tail step (weak pretrain-long at 256 GPUs, packed in micro-batches of
    preferred size, with sub-groups), the times the packing priced its micro-batches at
    (`step_plan`'s `times`) are `mb_costs`' to the bit, in the plan's order; so the score from
    them (`StepSeconds.priced`) is the score, and the `dcp` candidate that packs proposes the
    plan with exactly the score's prediction."""
    packer, step = _weak_first_step("text", "pretrain-long", 256)
    ctx = packer.ctx
    got = packer.plan(list(step.sample_ids), DEFAULT.pack_max_items)
    priced: list[float] = []
    plan = packer.step_plan(step, got.groups, priced)
    assert plan.num_phases > 1  # sub-groups met
    mbs = [mb for g in plan.groups for mb in g.micro_batches]
    assert len({mb.layout.sp for mb in mbs}) > 2 and len(mbs) > 500  # several degrees, grids priced
    assert priced == ctx.mb_costs(mbs)[0] == ctx.mb_costs(mbs, memory=False)[0]
    score = step_seconds(ctx)
    assert score.priced(plan, priced) == score(plan) == replay_step(plan, ctx).step_time
    dcp = DcpPlanner(ctx, score)
    facts = StepFacts(step, len(step.sample_ids), 256, score=lambda: math.inf)
    proposal = next(c for c in dcp.scored if c.name == "packing").propose(facts)
    assert proposal.predicted == score(proposal.plan)


def _pack_by_moves(packer: SamplePacker, ids, t, f, T, by_time, open_first):
    """`pack` as its loop was written before its first case was written out: every
    micro-batch placed by `fit` and `put` (the reference)."""
    cap = T * (1 + 1e-12)
    got = packer._placing_order(ids, t, f, cap, by_time, {})
    if got is None:
        return None
    order, _, nl, tl = got
    groups, fins = [], [[] for _ in packer.sp]
    put, fit = packer._placers(groups, fins, cap, {})
    ranks = 0
    for a in order:
        b, row = nl[a], tl[a]
        g = fit(b, row[b])
        if g is None and open_first and ranks + packer.sp[b] <= packer.world:
            ranks += packer.sp[b]
            groups.append(Node(b, 0.0, [], 0.0, None, []))
            g = len(groups) - 1
        d = b
        while g is None and d + 1 < len(packer.sp):
            d += 1
            if row[d] <= cap:
                g = fit(d, row[d])
        if g is not None:
            put(g, a, row[d])
            continue
        ranks += packer.sp[b]
        if ranks > packer.world:
            return None
        groups.append(Node(b, 0.0, [], 0.0, None, []))
        put(len(groups) - 1, a, row[b])
    return groups


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([4, 8, 16]),
    st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.5, 4.0, 7.0, 20.0]), st.floats(0.5, 1.0)), min_size=1, max_size=40),
    st.lists(st.floats(2.0, 80.0), min_size=1, max_size=4),
    st.booleans(),
    st.booleans(),
)
def test_packing_loop_places_as_its_moves_do(world, rows, targets, by_time, open_first):
    """`pack`'s inner loop (the own degree's fullest group with room, updated in place where
    its order among the open groups holds) packs exactly as `fit` and `put` (equal times:
    ties among the open groups), with sub-groups and without."""
    for packer in (_packer(world), FlatPacker(_packer(world).ctx, "pac")):
        t = np.array([[b * r**j for j in range(len(packer.sp))] for b, r in rows])
        f, ids = packer.alone(t), list(range(len(rows)))
        for T in targets:
            assert packer.pack(ids, t, f, T, by_time, open_first) == _pack_by_moves(
                packer, ids, t, f, T, by_time, open_first
            )


def test_packing_loop_places_a_real_step_as_its_moves_do():
    """The same on a heavy-tail step (weak pretrain-long at 256 GPUs, micro-batches of
    preferred size), at targets from below its floor (no packing) to above (sub-groups)."""
    packer, step = _weak_first_step("text", "pretrain-long", 256)
    items = packer.items(list(step.sample_ids))
    t = packer.times(items)
    f, ids = packer.alone(t), [it[0] for it in items]
    floor = max(float(f.min(axis=1).max()), float((t * packer.kf).min(axis=1).sum()) / 256)
    packed = 0
    for T, by_time, open_first in ((floor, False, True), (floor * 1.02, True, False), (floor * 1.1, False, False)):
        got = packer.pack(ids, t, f, T, by_time, open_first)
        assert got == _pack_by_moves(packer, ids, t, f, T, by_time, open_first)
        packed += got is not None and any(g.base is not None for g in got)
    assert packed >= 1  # sub-groups met


def test_packing_loop_places_runs_of_video_clips_as_its_moves_do():
    """The same on a video step of few clips per GPU (the first 1/8 of a weak video-mix step
    at 256 GPUs: 714 clips, 2.8 per GPU, in 323 micro-batches of half the preferred size),
    where most micro-batches follow one of the same degree and time (`same`: the loop fills a
    group with a run of them at once), at targets from its floor up, in every order."""
    packer, step = _weak_first_step("video", "video-mix", 256)
    ids = list(step.sample_ids)[: len(step.sample_ids) // 8]
    items = packer.items(ids, split=2)
    t = packer.times(items)
    f, first = packer.alone(t), [it[0] for it in items]
    floor = max(float(f.min(axis=1).max()), float((t * packer.kf).min(axis=1).sum()) / 256)
    packed = runs = split = 0
    for T in (floor, floor * 1.05, floor * 1.2, floor * 1.5):
        for by_time, open_first in ((False, True), (False, False), (True, False)):
            got = packer.pack(first, t, f, T, by_time, open_first)
            assert got == _pack_by_moves(packer, first, t, f, T, by_time, open_first)
            packed += got is not None
            split += got is not None and any(g.base is not None for g in got)
            order = packer._placing_order(first, t, f, T * (1 + 1e-12), by_time, {})
            runs = max(runs, 0 if order is None else sum(order[1]) / len(items))
    assert packed >= 6 and split >= 2 and runs > 0.5  # packings, sub-groups, most micro-batches in runs
