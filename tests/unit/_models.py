"""Small models and clusters for planner tests: the analytic H200 model scaled down, with a
memory budget under which long samples need sequence parallelism or recomputation."""

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.spec import ClusterSpec, llama_like, stdit_like

TINY_LM = llama_like("tiny-lm", num_layers=4, hidden=256, num_heads=8, ffn_hidden=688, vocab_size=1000)
TINY_DIT = stdit_like("tiny-dit", num_pairs=2, hidden=128, num_heads=8, context_tokens=16)

MiB = 2**20


def cluster(world: int, gpus_per_node: int = 8, memory_mib: int = 1536) -> ClusterSpec:
    return ClusterSpec(world_size=world, gpus_per_node=gpus_per_node, memory_bytes=memory_mib * MiB,
                       intra_bw=300e9, intra_latency=10e-6, inter_bw=40e9, inter_latency=20e-6)


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
