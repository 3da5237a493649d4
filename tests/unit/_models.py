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
