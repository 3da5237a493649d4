"""Ulysses x ring geometry without a process group: the zigzag columns each rank holds, the
(u, r) splits the topology offers, the layout's ring degree, and the collation's shards."""

from __future__ import annotations

import pytest
import torch

from dcparallel.data.collate import text_batch
from dcparallel.data.ring_order import block_columns, ring_padded_length, shard_columns
from dcparallel.plan.types import MicroBatch
from dcparallel.spec import ClusterSpec, Layout, Recompute
from dcparallel.topology import Topology


def test_zigzag_blocks_pair_early_and_late_chunks_and_tile_the_row():
    # 16 columns, ring 4: 8 chunks of 2; block j = chunks j and 7 - j
    assert block_columns(16, 4, 0) == [0, 1, 14, 15]
    assert block_columns(16, 4, 3) == [6, 7, 8, 9]
    # SP 8 = u 2 x r 4: slot j*2 + i holds half i of block j, and every column once
    assert shard_columns(16, 8, 4, 1) == [14, 15]
    assert shard_columns(16, 8, 4, 6) == [6, 7]
    cols = [c for s in range(8) for c in shard_columns(16, 8, 4, s)]
    assert sorted(cols) == list(range(16))
    # ring 1 is Ulysses' contiguous sharding
    assert shard_columns(12, 4, 1, 2) == [6, 7, 8]


def test_causal_work_is_the_same_on_every_ring_block():
    """Key columns at or before each query column, summed per block: equal under zigzag
    (contiguous blocks would give the last block 2r - 1 times the first's)."""
    padded, ring = 32, 4
    work = [sum(c + 1 for c in block_columns(padded, ring, j)) for j in range(ring)]
    assert len(set(work)) == 1, work


def test_padded_length_under_ring_cuts_into_2r_chunks_of_u_pieces():
    assert ring_padded_length(27, 4, 1) == 28
    assert ring_padded_length(27, 4, 2) == 32
    with pytest.raises(ValueError, match="2 x 4 equal chunks"):
        block_columns(12, 4, 0)


def test_topology_offers_sizes_beyond_the_heads_only_with_ring():
    cluster = ClusterSpec(world_size=8, gpus_per_node=8)
    assert Topology.of(cluster, 2).sizes == (1, 2)
    topo = Topology.of(cluster, 2, ring=True)
    assert topo.sizes == (1, 2, 4, 8)
    assert topo.splits(8) == [(1, 8), (2, 4)]  # u divides the 2 heads
    assert Topology.of(cluster, 4, ring=True).splits(4) == [(1, 4), (2, 2), (4, 1)]
    assert Topology.of(cluster, 4).splits(4) == [(4, 1)]


def test_layout_ring_degree_divides_sp_and_round_trips_json():
    lay = Layout(4, 1, Recompute(1, 0), ring=2)
    assert lay.ulysses == 2 and Layout.from_json(lay.to_json()) == lay
    assert "ring" not in Layout(4, 1).to_json()  # Ulysses-only plans serialize as before
    with pytest.raises(ValueError, match="ring degree 3 must divide sp=4"):
        Layout(4, 1, ring=3)


def test_text_shards_under_ring_are_the_zigzag_columns_of_the_packed_row():
    docs = {0: torch.arange(10, 15), 1: torch.arange(20, 29)}  # 14 tokens, padded to 16 at SP 4 x ring 2
    mb = MicroBatch((0, 1), Layout(4, 2, ring=2))
    row = torch.cat([docs[0], docs[1], torch.zeros(2, dtype=torch.long)])
    pos = torch.cat([torch.arange(5), torch.arange(9), torch.zeros(2, dtype=torch.long)])
    for slot in range(4):
        b = text_batch(mb, (0, 1, 2, 3), slot, docs)
        cols = shard_columns(16, 4, 2, slot)
        assert b.shard_columns() == cols and b.padded_len == 16
        assert b.inputs[0].tolist() == row[cols].tolist()
        assert b.positions[0].tolist() == pos[cols].tolist()
        assert bool(b.loss_mask[0, [c >= 14 for c in cols]].any()) is False  # padding has no target
        assert b.shard_sample(torch.arange(14))[[c < 14 for c in cols]].tolist() == [c for c in cols if c < 14]
    with pytest.raises(ValueError, match="zigzag columns"):
        _ = b.shard_start


def _video_batch(slot: int, ring: int = 2):
    from dcparallel.data.collate import video_batch

    tokens = {0: torch.arange(13 * 2, dtype=torch.float32).view(13, 2)}
    positions = {0: torch.zeros(13, 3, dtype=torch.long)}
    return video_batch(MicroBatch((0,), Layout(4, 1, ring=ring)), (0, 1, 2, 3), slot, tokens, positions, 1)


def test_joint_attention_under_ring_shards_over_the_whole_sp_group():
    """Under ring the joint-attention hooks cut and gather over the whole SP group (the
    ring's group, whose ranks are the slots), not the Ulysses sub-group."""
    import dataclasses

    from dcparallel.adapters import joint
    from dcparallel.runtime.ring import RingPeers
    from dcparallel.runtime.ulysses import UlyssesAttention

    attention = UlyssesAttention()
    batch = dataclasses.replace(_video_batch(0), sharded=False)
    attention.activate("ulysses-group", batch.cu_seqlens, batch, RingPeers("ring-group", (0, 1), 0))
    assert joint.sharding(attention) == ("ring-group", batch)
    x = torch.arange(13.0)[None, :, None]
    assert joint.shard_tokens(x, batch)[0, :, 0].tolist() == [c if c < 13 else 0 for c in batch.shard_columns()]


def test_a_models_own_split_and_gather_follow_the_zigzag_columns(monkeypatch):
    """`adapters.cp_plan`'s cut of a whole sequence is the batch's zigzag shard, and joining
    the group's shards in rank order gives the sequence back, padding dropped."""
    from dcparallel.adapters import cp_plan

    x = torch.randn(2, 13, 3)
    shards = []
    for slot in range(4):
        b = _video_batch(slot)
        s = cp_plan.shard(x, 1, b)
        cols = b.shard_columns()
        real = [c < 13 for c in cols]
        assert s.shape == (2, 4, 3) and torch.equal(s[:, real], x[:, [c for c in cols if c < 13]])
        assert float(s[:, [not r for r in real]].abs().sum()) == 0.0
        shards.append(s)
    whole = torch.cat(shards, dim=1)  # what the group's gather_seq returns: the shards in rank order
    monkeypatch.setattr(cp_plan.comm, "gather_seq", lambda t, group, dim: whole)
    assert torch.equal(cp_plan.gather(shards[1], 1, None, _video_batch(1)), x)
