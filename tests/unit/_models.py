"""Small models and clusters for planner tests: the analytic H200 model scaled down, with a
memory budget under which long samples need sequence parallelism or recomputation."""

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.sim.replay import simulate, step_seconds
from dcparallel.spec import ClusterSpec, Workload, llama_like, stdit_like
from dcparallel.topology import allowed_groups

TINY_LM = llama_like("tiny-lm", num_layers=4, hidden=256, num_heads=8, ffn_hidden=688, vocab_size=1000)
TINY_DIT = stdit_like("tiny-dit", num_pairs=2, hidden=128, num_heads=8, context_tokens=16)

MiB = 2**20


def cluster(world: int, gpus_per_node: int = 8, memory_mib: int = 1536) -> ClusterSpec:
    return ClusterSpec(
        world_size=world,
        gpus_per_node=gpus_per_node,
        memory_bytes=memory_mib * MiB,
        intra_bw=300e9,
        intra_latency=10e-6,
        inter_bw=40e9,
        inter_latency=20e-6,
    )


def cost(model, c: ClusterSpec) -> AnalyticCost:
    return AnalyticCost(model, c)


#: video sizes (frames, height, width) of several latent grids, for property tests
VIDEO_SHAPES = [(1, 64, 64), (1, 128, 128), (17, 64, 64), (34, 128, 128), (51, 128, 224), (68, 256, 256)]


def draw_samples(draw, st, n: int):
    """(model, sizes) of ``n`` samples drawn by a hypothesis ``draw``: video shapes for the tiny
    DiT or text lengths 16..40k for the tiny LM (``st`` is hypothesis.strategies)."""
    if draw(st.booleans()):
        return TINY_DIT, tuple(draw(st.lists(st.sampled_from(VIDEO_SHAPES), min_size=n, max_size=n)))
    return TINY_LM, tuple(draw(st.lists(st.integers(16, 40_000), min_size=n, max_size=n)))


def check_dcp_epoch(model, sizes, cl: ClusterSpec, seed: int, steps_per_epoch: int, ranks: int = 2) -> list:
    """`dcp` plans an epoch of these samples twice from scratch (two "ranks", nothing shared):
    the same plans; each a valid plan of its step (aligned blocks of allowed sizes, each phase
    covering the world once, every sample once) whose per-rank view is that rank's groups;
    every sample planned once in the epoch, memory kept, and no faster than the lower bound.
    Returns the epoch's plans (a test may compare them with another process's). ``ranks=1``
    plans once: for a test that compares them with another process's plans instead."""
    w = Workload(model, sizes)
    steps = form_steps(w.tokens, seed=seed, tokens_per_step=max(1, sum(w.tokens) // steps_per_epoch))
    allowed = set(allowed_groups(cl, model.num_heads))
    plans = []
    for _ in range(ranks):
        ctx = PlanContext(w, cost(model, cl), cl)
        planner = make_planner("dcp", ctx, steps, score=step_seconds(ctx))
        plans.append([planner.plan(s) for s in steps])
    assert all([p.to_json() for p in plans[0]] == [p.to_json() for p in other] for other in plans[1:])
    for p, s in zip(plans[0], steps):
        assert p.sample_ids == s.sample_ids
        p.validate(cl.world_size, allowed)
        for rank in sorted({0, cl.world_size // 2, cl.world_size - 1}):  # what one rank's loader reads
            assert p.groups_of(rank) == tuple(g for g in p.groups if rank in g.ranks)
    used = sorted(i for p in plans[0] for mb in p.micro_batches() for i in mb.sample_ids)
    assert used == list(range(len(sizes)))
    sim = simulate(plans[0], ctx)
    assert sim.memory_violations == 0
    assert sim.total_time >= LowerBound(ctx).epoch(steps) * (1 - 1e-9)
    return plans[0]
