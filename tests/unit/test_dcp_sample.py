"""`dcp`'s per-sample packing (`plan.dcp_sample`), used for steps with few samples per GPU:
lossless, tiling, within memory, identical from scratch, its prediction the simulator's, and
chosen by `dcp` where it beats the class-level plan."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp_sample import SamplePacker
from dcparallel.plan.dcp_scale import ScalePlanner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import SCENARIOS, sample_sizes
from dcparallel.sim.replay import replay_step, step_seconds
from dcparallel.spec import Workload
from dcparallel.topology import allowed_groups

from ._models import cluster, cost, draw_samples


@st.composite
def few_per_gpu(draw):
    world = draw(st.sampled_from([1, 4, 24, 128, 512, 1024, 4096]))
    n = draw(st.integers(1, 80))
    model, sizes = draw_samples(draw, st, n)
    return model, sizes, cluster(world, min(8, world)), draw(st.integers(0, 3))


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
        assert sorted(i for _, _, items in groups for item in items for i in item) == sorted(s.sample_ids)
        assert sum(k for k, _, _ in groups) <= cl.world_size
        plan = packer.step_plan(s, groups)
        plan.validate(cl.world_size, allowed)
        r = replay_step(plan, ctx)
        assert r.memory_violations == 0
        assert abs(r.step_time - span) <= 1e-9 * span  # the packer predicts exactly what is simulated
        assert r.step_time >= lb.step(s) * (1 - 1e-9)
        for g, (k, _, ids) in zip(plan.groups, groups):  # longest last: it hides the sync
            times = [ctx.mb_time(mb.sample_ids, mb.layout) for mb in g.micro_batches]
            assert times == sorted(times) and len(g.ranks) == k
            assert [mb.sample_ids for mb in g.micro_batches] == ids


def test_dcp_packs_sample_by_sample_when_few_samples_per_gpu_beat_the_classes():
    """The text scenario's long-context mix (7B model, H200 calibration) at 0.375 samples per
    GPU on 256 GPUs: the class-level plan times every sample of a bucket as its largest;
    packing them one by one finishes sooner, and `dcp` keeps the faster plan."""
    sc = SCENARIOS["text"]
    cl = sc.cluster(256)
    sizes = tuple(sample_sizes("text", "long", epoch_tokens=sc.tokens_per_step * 4))[:96]
    w = Workload(sc.model, sizes)
    ctx = PlanContext(w, AnalyticCost(sc.model, cl), cl)
    step = form_steps(w.tokens, seed=0, samples_per_step=96)[0]
    p = ScalePlanner(ctx, step_seconds(ctx))
    class_plan, _, _ = p._plan(step)
    packed, span = p.packer.plan(list(step.sample_ids))
    chosen = p.plan(step)
    t = p.score
    assert span < t(class_plan) * 0.9, (span, t(class_plan))  # 3.69 s against 4.69 s when written
    assert t(chosen) <= min(t(class_plan), span) * (1 + 1e-9)
    assert chosen.to_json() == p.packer.step_plan(step, packed).to_json()  # the packed plan was kept
