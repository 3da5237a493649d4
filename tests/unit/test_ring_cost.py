"""The cost model's (Ulysses u, ring r) split of an SP group (`cost.ring`), on an 8B Llama
shape (32 query heads, 8 key/value heads): which split it predicts fastest, and that the
choice follows the cluster's link speeds."""

from __future__ import annotations

import dataclasses

import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.ring import split_time
from dcparallel.spec import h200_cluster, llama_like

LLAMA_8B = dataclasses.replace(
    llama_like("llama-8b", num_layers=32, hidden=4096, num_heads=32, ffn_hidden=14336, vocab_size=128256),
    num_kv_heads=8,
)


def _pcie(world: int, bw: float = 25e9):
    """One node whose GPUs talk over PCIe-class links (25 GB/s, 20 us) instead of NVLink."""
    return dataclasses.replace(h200_cluster(world, world), intra_bw=bw, intra_latency=20e-6, name="pcie")


def _times(cost: AnalyticCost, n: int, sp: int) -> dict[tuple[int, int], float]:
    m = cost.model
    return {
        (u, sp // u): split_time(m, cost.cluster, u, sp // u, n, m.attention_pairs(n), cost._attn).seconds
        for u in (1, 2, 4, 8, 16)
        if sp % u == 0
    }


def test_pcie_links_pick_ring_for_a_long_sample_where_ulysses_loses():
    cost = AnalyticCost(LLAMA_8B, _pcie(8))
    best = cost.best_split([131072], 8)
    times = _times(cost, 131072, 8)
    assert best.ring > 1 and (best.ulysses, best.ring) == min(times, key=times.get)
    # Ulysses' all-to-alls lie bare on the slow link; the ring's sends hide under the block
    # attention, and its merges cost less than the all-to-alls
    assert times[(8, 1)] > 2.5 * best.seconds, times
    # a short sample has too little attention to hide the ring's sends: Ulysses
    assert (cost.best_split([8192], 8).ulysses, cost.best_split([8192], 8).ring) == (8, 1)


def test_two_nodes_run_ulysses_inside_a_node_and_ring_across():
    cost = AnalyticCost(LLAMA_8B, h200_cluster(16, 8))
    best = cost.best_split([32768], 16)
    assert (best.ulysses, best.ring) == (8, 2)
    assert _times(cost, 32768, 16)[(16, 1)] > 3 * best.seconds  # Ulysses 16 crosses the inter-node link


@pytest.mark.parametrize(("inter_bw", "split"), [(200e9, (4, 4)), (100e9, (4, 4)), (40e9, (8, 2)), (12.5e9, (8, 2))])
def test_the_split_follows_the_inter_node_link_speed(inter_bw, split):
    """A 16k-token sample at SP 16 on two nodes: the slower the inter-node link, the less of
    the sequence the ring moves across it (a larger Ulysses degree inside each block)."""
    cost = AnalyticCost(LLAMA_8B, dataclasses.replace(h200_cluster(16, 8), inter_bw=inter_bw))
    best = cost.best_split([16384], 16)
    assert (best.ulysses, best.ring) == split


def test_heads_that_do_not_divide_the_group_leave_only_ring_splits():
    model = dataclasses.replace(LLAMA_8B, num_heads=24, num_kv_heads=8, hidden=3072)
    cost = AnalyticCost(model, h200_cluster(16, 8))
    assert cost.best_split([65536], 16).ring >= 2  # 16 does not divide 24: Ulysses alone cannot run
    with pytest.raises(ValueError, match="no Ulysses x ring split"):
        cost.best_split([65536], 32)
