"""Samples, models, clusters and the allowed groups (no process group)."""

import pytest

from dcparallel.spec import (
    LLAMA_7B,
    STDIT_1B,
    ClusterSpec,
    Layout,
    Recompute,
    Workload,
    bucket_key,
    check_size,
    h200_cluster,
)
from dcparallel.topology import allowed_groups, group_sizes, sp_chain


def test_video_tokens_follow_open_sora_patchify():
    # latent frames = frames * 5 // 17 (1 for images), spatial = ceil(h/16) * ceil(w/16)
    assert STDIT_1B.latent_grid((1, 144, 256)) == (1, 144)
    assert STDIT_1B.latent_grid((51, 240, 426)) == (15, 405)
    assert STDIT_1B.tokens((408, 720, 1280)) == 120 * 3600
    assert STDIT_1B.tokens((102, 480, 853)) == 30 * 1620


def test_attention_pairs_by_pattern():
    assert LLAMA_7B.attention_pairs(4) == 10  # causal: n(n+1)/2
    t, s = 15, 405
    assert STDIT_1B.attention_pairs((51, 240, 426)) == t * s * s + s * t * t


def test_stdit_parameter_count_matches_calibration():
    # h200_stdit_buckets.jsonl: one block pair has 42,492,672 parameters; 28 pairs ~ 1.19 B
    per_pair = (STDIT_1B.num_params) / STDIT_1B.num_layers
    assert abs(per_pair - 42_492_672) / 42_492_672 < 0.01


def test_allowed_groups_are_aligned_blocks():
    c = ClusterSpec(world_size=16, gpus_per_node=8)
    groups = allowed_groups(c, num_heads=16)
    assert group_sizes(c, 16) == [1, 2, 4, 8, 16]
    for g in groups:
        k = len(g)
        assert g[0] % k == 0 and list(g) == list(range(g[0], g[0] + k))
        if k <= 8:
            assert g[0] // 8 == g[-1] // 8  # inside one node
    assert len(groups) == 16 + 8 + 4 + 2 + 1
    # heads limit the degree: 12 heads allow 1, 2, 4 only (8 and 16 do not divide 12)
    assert group_sizes(c, 12) == [1, 2, 4]


def test_group_sizes_multiple_of_node_and_small_world():
    assert group_sizes(ClusterSpec(world_size=32, gpus_per_node=8), 32) == [1, 2, 4, 8, 16, 32]
    assert group_sizes(ClusterSpec(world_size=6, gpus_per_node=8), 8) == [1, 2, 4]
    assert allowed_groups(ClusterSpec(world_size=6, gpus_per_node=8), 8)[-1] == (0, 1, 2, 3)


def test_sp_chain_is_a_divisibility_chain():
    c = ClusterSpec(world_size=6, gpus_per_node=6)
    chain = sp_chain(c, 6)
    assert all(b % a == 0 for a, b in zip(chain, chain[1:]))
    assert sp_chain(h200_cluster(), 16) == [1, 2, 4, 8, 16]


def test_cluster_rejects_partial_nodes():
    with pytest.raises(ValueError, match="not a whole number of nodes"):
        ClusterSpec(world_size=12, gpus_per_node=8)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ClusterSpec(world_size=0)


@pytest.mark.parametrize("bad", [0, -3, 2.5, (1, 2), (0, 144, 256), True])
def test_bad_sizes_are_named(bad):
    with pytest.raises(ValueError, match="sample 7"):
        check_size(bad, 7)


def test_workload_validates_and_counts_tokens():
    w = Workload(STDIT_1B, ((1, 144, 256), [51, 240, 426]))
    assert w.tokens == (144, 6075)
    assert w.sizes[1] == (51, 240, 426)
    with pytest.raises(ValueError, match="empty"):
        Workload(LLAMA_7B, ())


def test_layout_roundtrip_and_validation():
    lay = Layout(4, 2, Recompute(3, 32))
    assert Layout.from_json(lay.to_json()) == lay
    with pytest.raises(ValueError):
        Layout(0, 1)
    assert Recompute.full(8).describe(8) == "full" and Recompute().describe(8) == "none"


def test_text_buckets_are_geometric():
    # x1.25 ranges [1.25^31, 1.25^32) = [1009.7, 1262.2): 1024 and 1250 share a bucket, 1300 does not
    assert bucket_key(LLAMA_7B, 1024) == bucket_key(LLAMA_7B, 1250)
    assert bucket_key(LLAMA_7B, 1024) != bucket_key(LLAMA_7B, 1300)
    assert bucket_key(LLAMA_7B, 1000) != bucket_key(LLAMA_7B, 1024)
    assert bucket_key(STDIT_1B, (51, 240, 426)) != bucket_key(STDIT_1B, (51, 360, 640))
