"""Planning with parameter-shard blocks (`ClusterSpec.shard_size`): the cluster's rule, the
topology's sizes, the sharded memory and time, `auto_shard_size`, every policy keeping a block
inside one group, and `simulate --model / --model-config / --shard-size`."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.auto_shard import auto_shard_size
from dcparallel.cost.base import gathered_bytes, grad_sync_time, model_state_bytes
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import MODEL_PRESETS, sample_sizes
from dcparallel.sim.replay import simulate, step_seconds
from dcparallel.spec import ClusterSpec, GiB, Recompute, Workload, h200_cluster, llama_like
from dcparallel.topology import Topology, allowed_groups
from tests.unit._models import TINY_DIT, TINY_LM, VIDEO_SHAPES, cluster

LLAMA_70B = MODEL_PRESETS["llama-70b"]


# ---------------------------------------------------------------- the cluster and the topology


@pytest.mark.parametrize(
    "world,gpn,s,needed",
    [
        (8, 8, 3, "a power of two"),
        (8, 8, 16, "a divisor of the world size 8"),
        (12, 6, 4, "a power of two dividing the 6 GPUs per node"),
        (8, 8, 0, "a positive integer"),
        (32, 8, 64, "a divisor of the world size 32"),
    ],
)
def test_a_shard_size_the_cluster_cannot_tile_is_refused_with_the_sizes_it_allows(world, gpn, s, needed):
    with pytest.raises(ValueError, match=needed) as e:
        ClusterSpec(world_size=world, gpus_per_node=gpn, shard_size=s)
    assert f"shard_size={s}" in str(e.value) and "use one of" in str(e.value)


def test_shard_sizes_divide_a_node_or_are_whole_nodes():
    assert ClusterSpec(world_size=32, gpus_per_node=8).shard_sizes() == [1, 2, 4, 8, 16, 32]
    assert ClusterSpec(world_size=12, gpus_per_node=6).shard_sizes() == [1, 2, 6, 12]
    assert ClusterSpec(world_size=24, gpus_per_node=6).shard_sizes() == [1, 2, 6, 12, 24]  # whole nodes, not 18


@pytest.mark.parametrize("world,gpn,heads", [(32, 8, 32), (64, 8, 64), (24, 6, 48), (48, 12, 48), (16, 8, 40)])
def test_the_topology_offers_no_size_below_the_shard_size_and_keeps_blocks_whole(world, gpn, heads):
    for s in ClusterSpec(world_size=world, gpus_per_node=gpn).shard_sizes():
        try:
            top = Topology(world, gpn, heads, s)
        except ValueError as e:
            assert "no SP group size" in str(e) and f"shard size {s}" in str(e)
            continue
        assert top.sizes and min(top.sizes) >= s and all(k % s == 0 for k in top.sizes)
        assert set(top.chain) <= set(top.sizes) and set(top.mix) <= set(top.sizes)
        for g in top.blocks():  # every group holds whole shard blocks
            assert g[0] % s == 0 and len(g) % s == 0
        if s == 1:
            assert top == Topology.of(ClusterSpec(world_size=world, gpus_per_node=gpn), heads)


# ---------------------------------------------------------------- memory and time


def test_model_states_shrink_with_the_shard_size_as_stated():
    p, w = LLAMA_70B.num_params, 64
    assert model_state_bytes(LLAMA_70B, w) == p * (2 + 4 + 12 / w)
    assert model_state_bytes(LLAMA_70B, w, 1) == p * (2 + 4 + 12 / w)
    gathered = 2 * 2 * LLAMA_70B.extra_params + 10 * LLAMA_70B.unit_params
    assert gathered_bytes(LLAMA_70B) == gathered
    for s in (2, 4, 8):
        assert model_state_bytes(LLAMA_70B, w, s) == pytest.approx(p * 8 / s + 8 * p / w + gathered, rel=1e-12)
    one, two, four = (model_state_bytes(LLAMA_70B, w, s) for s in (1, 2, 4))
    assert four < two < one
    # fp32 parameter + gradient shards per rank halve from s = 2 to s = 4
    assert (four - 8 * p / w - gathered) == pytest.approx((two - 8 * p / w - gathered) / 2)
    # the cost model carries them into every micro-batch's memory
    for s in (1, 4):
        c = AnalyticCost(LLAMA_70B, h200_cluster(64, shard_size=s))
        assert c.model_state_bytes() == model_state_bytes(LLAMA_70B, 64, s)
        assert c.terms((4096,), 8).fixed_bytes >= c.model_state_bytes()


def test_more_smaller_micro_batches_cost_more_under_sharding_and_the_sync_shrinks():
    m = MODEL_PRESETS["llama-8b"]
    plain = AnalyticCost(m, h200_cluster(64))
    sharded = AnalyticCost(m, h200_cluster(64, shard_size=8))
    none = Recompute()
    for n in (256, 2048, 16384):
        one = sharded.terms_copies(n, 16, 8).time(none)
        many = 16 * sharded.terms_copies(n, 1, 8).time(none)
        # the block's collectives are paid per micro-batch: 16 micro-batches pay them 16 times
        extra_many = many - 16 * plain.terms_copies(n, 1, 8).time(none)
        extra_one = one - plain.terms_copies(n, 16, 8).time(none)
        assert extra_many > extra_one >= 0
        assert many > one
    # never faster with more samples (the planners and the lower bound rely on it)
    times = [sharded.terms_copies(1024, k, 8).time(none) for k in range(1, 40)]
    assert times == sorted(times)
    # a tiny micro-batch pays at least the gathers of every layer (forward and backward)
    layer = m.attn_params + m.mlp_params + m.other_params
    assert sharded.terms_copies(16, 1, 8).time(none) > m.num_layers * 2 * (2 * layer * 7 / 8) / 315e9
    # each rank syncs 1/s of the gradients over the replicas: less than half an all-reduce of them all
    from dcparallel.cost.base import allreduce_time

    assert 0 < grad_sync_time(m, sharded.cluster) < allreduce_time(plain.cluster, 4.0 * m.trainable_params) / 2
    # a block larger than a node pays the inter-node link
    wide = AnalyticCost(m, h200_cluster(64, shard_size=16))
    assert wide.terms_copies(2048, 1, 16).time(none) > sharded.terms_copies(2048, 1, 16).time(none)


def test_the_replica_sync_is_the_hierarchical_all_reduce_of_a_shard():
    from dcparallel.cost.base import allreduce_time, replica_sync_time

    for world, gpn in ((8, 8), (64, 8), (4, 8), (48, 12)):
        one = h200_cluster(world, gpn)
        assert replica_sync_time(one, 1e9) == pytest.approx(allreduce_time(one, 1e9))
    # blocks of 2 on 8-GPU nodes: 4 replicas per node, 8 nodes; blocks of a node: a ring over 8 nodes
    two, node = h200_cluster(64, shard_size=2), h200_cluster(64, shard_size=8)
    intra = 2 * 3 / 4 * 1e9 / two.intra_bw + 6 * two.intra_latency
    assert replica_sync_time(two, 1e9) == pytest.approx(
        intra + 2 * 7 / 8 * 1e9 / 4 / two.inter_bw + 14 * two.inter_latency
    )
    assert replica_sync_time(node, 1e9) == pytest.approx(2 * 7 / 8 * 1e9 / node.inter_bw + 14 * node.inter_latency)
    assert replica_sync_time(h200_cluster(8, shard_size=8), 1e9) == 0.0  # one block: no replica


def test_a_profile_measured_unsharded_plans_shard_blocks():
    from tests.unit.test_cost import _profile

    prof = Profile.from_json(_profile())
    cl = cluster(2, 2)
    plain = ProfiledCost(prof, cl)
    sharded = ProfiledCost(prof, dataclasses.replace(cl, shard_size=2))
    p = TINY_LM.num_params
    assert sharded.model_state_bytes() == pytest.approx(1000.0 - p * 6 / 2 + gathered_bytes(TINY_LM))
    assert sharded.terms((1000,), 2).time(Recompute()) > plain.terms((1000,), 2).time(Recompute())
    assert sharded.grad_sync_time() != plain.grad_sync_time()
    other = Profile.from_json({**_profile(), "shard_size": 2})
    assert ProfiledCost(other, dataclasses.replace(cl, shard_size=2)).model_state_bytes() == 1000.0
    with pytest.raises(ValueError, match="measured at shard size 2"):
        ProfiledCost(other, cl)


def test_cost_and_cluster_must_agree_on_the_shard_size():
    cl = cluster(8)
    w = Workload(TINY_LM, (100, 200))
    with pytest.raises(ValueError, match="shard blocks of 1 ranks but the cluster plans for 2"):
        PlanContext(w, AnalyticCost(TINY_LM, cl), dataclasses.replace(cl, shard_size=2))


# ---------------------------------------------------------------- auto


def test_auto_picks_a_shard_size_for_70b_on_64_h200_and_1_for_8b():
    sizes = sample_sizes("text", "balanced", num_samples=500)
    c64 = h200_cluster(64)
    s = auto_shard_size(LLAMA_70B, c64, sizes)
    assert s > 1
    cost = AnalyticCost(LLAMA_70B, dataclasses.replace(c64, shard_size=s))
    assert cost.model_state_bytes() < c64.memory_bytes
    # the smallest: one less does not fit
    smaller = AnalyticCost(LLAMA_70B, dataclasses.replace(c64, shard_size=s // 2))
    top = Topology.of(smaller.cluster, LLAMA_70B.num_heads)
    L = LLAMA_70B.num_layers
    assert (
        smaller.terms((min(sizes),), top.sizes[0]).memory(Recompute(L, L)) > c64.memory_bytes
        or smaller.terms((max(sizes),), top.sizes[-1]).memory(Recompute(L, L)) > c64.memory_bytes
    )
    assert auto_shard_size(MODEL_PRESETS["llama-8b"], c64, sizes) == 1
    assert auto_shard_size(LLAMA_70B, c64) <= s  # states alone need no more


def test_auto_names_the_model_the_memory_and_the_fix_when_nothing_fits():
    with pytest.raises(ValueError) as e:
        auto_shard_size(LLAMA_70B, h200_cluster(8), [1024, 4096])
    msg = str(e.value)
    assert "llama-70b" in msg and "70.55B" in msg and "128 GiB" in msg and "needs" in msg and "more GPUs" in msg
    with pytest.raises(ValueError, match="does not fit"):
        auto_shard_size(LLAMA_70B, h200_cluster(64, memory_bytes=8 * GiB))


# ---------------------------------------------------------------- every policy keeps blocks whole

POLICIES = ["dcp", "bucket", "packed", "megatron-dcp", "hbp", "dcp-v1", "dcp-inter-pac", "dcp-intra", "flexsp"]


def _check_shard_blocks(plan, world: int, s: int, allowed) -> None:
    plan.validate(world, allowed | {(r,) for r in range(world)})  # idle ranks: groups of one, running nothing
    for g in plan.groups:
        if g.micro_batches:
            assert len(g.ranks) >= s and len(g.ranks) % s == 0 and g.ranks[0] % s == 0, (g.ranks, s)
            assert g.ranks in allowed
        else:
            assert len(g.ranks) == 1 or g.ranks in allowed
    plan.check_shard_blocks(s)


def test_a_plan_that_cuts_a_shard_block_is_refused():
    from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
    from dcparallel.spec import Layout

    mb = MicroBatch((0,), Layout(2, 1))
    ok = StepPlan(0, (0,), (GroupPlan((0, 1), (mb,)), GroupPlan((2,), ()), GroupPlan((3,), ())), 10)
    ok.check_shard_blocks(2)
    bad = StepPlan(0, (0,), (GroupPlan((0,), ()), GroupPlan((1, 2), (mb,)), GroupPlan((3,), ())), 10)
    with pytest.raises(ValueError, match="splits a parameter-shard block of 2 ranks"):
        bad.check_shard_blocks(2)
    with pytest.raises(ValueError, match=r"ranks \(0, 1\) runs micro-batches"):
        ok.check_shard_blocks(4)


#: 12 heads on 12-GPU nodes: sizes 2, 4, 6, 12 with shard blocks of 2 are not one chain, so
#: `dcp` packs mixed sizes node by node (`Topology.mix`)
LM12 = llama_like("tiny-lm12", num_layers=4, hidden=384, num_heads=12, ffn_hidden=1024, vocab_size=1000)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_policy_plans_a_group_smaller_than_the_shard_size_or_unaligned(data):
    world = data.draw(st.sampled_from([4, 8, 12, 16, 24, 32]))
    gpn = data.draw(st.sampled_from([4, 8, 12]))
    if world > gpn and world % gpn or world < gpn:
        world = gpn
    s = data.draw(
        st.sampled_from([k for k in ClusterSpec(world_size=world, gpus_per_node=gpn).shard_sizes() if k > 1 and k <= 8])
    )
    policy = data.draw(st.sampled_from(POLICIES if world <= 8 else POLICIES[:-1]))
    n = data.draw(st.integers(3, 40))
    if gpn == 12:
        model, sizes = LM12, tuple(data.draw(st.lists(st.integers(16, 30_000), min_size=n, max_size=n)))
    elif data.draw(st.booleans()):
        model, sizes = TINY_DIT, tuple(data.draw(st.lists(st.sampled_from(VIDEO_SHAPES), min_size=n, max_size=n)))
    else:
        model, sizes = TINY_LM, tuple(data.draw(st.lists(st.integers(16, 30_000), min_size=n, max_size=n)))
    cl = dataclasses.replace(cluster(world, gpn, memory_mib=4096), shard_size=s)
    w = Workload(model, sizes)
    ctx = PlanContext(w, AnalyticCost(model, cl), cl)
    assert min(ctx.sp_sizes) >= s and min(ctx.mix_sizes) >= s
    steps = form_steps(w.tokens, seed=0, tokens_per_step=max(1, sum(w.tokens) // 3))
    planner = make_planner(policy, ctx, steps, score=step_seconds(ctx))
    allowed = set(allowed_groups(cl, model.num_heads))
    plans = [planner.plan(st_) for st_ in steps]
    for p in plans:
        _check_shard_blocks(p, world, s, allowed)
    assert simulate(plans, ctx).memory_violations == 0


@pytest.mark.parametrize("s", [2, 4])
def test_mixed_sizes_on_12_gpu_nodes_keep_shard_blocks_whole(s):
    cl = dataclasses.replace(cluster(24, 12, memory_mib=4096), shard_size=s)
    top = Topology.of(cl, LM12.num_heads)
    assert top.sizes == ((2, 4, 6, 12) if s == 2 else (4, 12))
    assert (6 in top.mix and 6 not in top.chain) == (s == 2)  # s = 2: mixed sizes packed node by node
    sizes = tuple(16 + (i * 7919) % 30_000 for i in range(60))
    w = Workload(LM12, sizes)
    ctx = PlanContext(w, AnalyticCost(LM12, cl), cl)
    steps = form_steps(w.tokens, seed=0, tokens_per_step=sum(w.tokens) // 3)
    allowed = set(allowed_groups(cl, LM12.num_heads))
    for pol in ("dcp", "bucket", "megatron-dcp", "hbp"):
        planner = make_planner(pol, ctx, steps, score=step_seconds(ctx))
        for st_ in steps:
            _check_shard_blocks(planner.plan(st_), 24, s, allowed)


def test_the_lower_bound_follows_the_sharded_cost_and_no_plan_beats_it():
    from dcparallel.plan.bounds import LowerBound
    from dcparallel.sim.replay import replay_step

    cl = h200_cluster(64, shard_size=8)
    sizes = sample_sizes("text", "balanced", num_samples=400)
    w = Workload(LLAMA_70B, tuple(sizes))
    ctx = PlanContext(w, AnalyticCost(LLAMA_70B, cl), cl)
    steps = form_steps(w.tokens, seed=0, tokens_per_step=2**20)[:2]
    bound = LowerBound(ctx)
    for pol in ("dcp", "bucket", "megatron-dcp"):
        planner = make_planner(pol, ctx, steps, score=step_seconds(ctx))
        for s_ in steps:
            plan = planner.plan(s_)
            plan.check_shard_blocks(8)
            assert bound.step(s_) <= replay_step(plan, ctx).step_time * (1 + 1e-9)
    # the bound prices the block's collectives: a step of short samples is slower than unsharded compute
    unsharded = AnalyticCost(LLAMA_70B, h200_cluster(64, memory_bytes=2**50))
    f_sharded = bound.degrees(256)[0][0]  # 256 tokens alone at SP 8
    assert f_sharded > unsharded.terms((256,), 8).time(Recompute())


# ---------------------------------------------------------------- simulate --model / --model-config


def _simulate_json(capsys, *args: str) -> dict:
    from dcparallel.apps.cli import main

    assert main(["simulate", *args, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_simulate_llama_70b_on_64_gpus_with_auto_shard_size(capsys):
    out = _simulate_json(
        capsys,
        "--model",
        "llama-70b",
        "--world",
        "64",
        "--shard-size",
        "auto",
        "--max-steps",
        "2",
        "--tokens-per-step",
        str(2**20),
        "--policy",
        "dcp",
        "--policy",
        "bucket",
    )
    assert out["model"] == "llama-70b" and out["num_params"] == LLAMA_70B.num_params
    assert out["shard_size"] > 1 and out["shard_size_auto"] is True
    assert out["model_state_bytes"] < out["peak_memory_bytes"] <= out["memory_bytes"]
    assert out["steps"] == 2
    for v in out["policies"].values():
        assert v["memory_violations"] == 0 and v["samples_dropped"] == 0 and v["epoch_time_s"] > 0


def test_simulate_auto_shard_size_with_ring_past_the_head_count(tmp_path, capsys):
    """Qwen2.5 32B (40 heads) on 16 GPUs with a 900k-token document: no SP group of 16 ranks
    divides the heads, so without ``--ring`` auto tries shard sizes up to 8, where the document
    does not fit, and the error names ring attention and the shard size it would allow; with
    ``--ring`` auto takes 16 and the document runs at SP 16 under ring attention."""
    from dcparallel.apps.cli import main

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["900000"] + ["4000"] * 60) + "\n")
    args = ["--model", "qwen-32b", "--world", "16", "--lengths", str(lengths), "--shard-size", "auto"]
    args += ["--max-steps", "1", "--tokens-per-step", str(2**20), "--policy", "dcp"]
    assert main(["simulate", *args, "--json", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "tried [1, 2, 4, 8]" in err and "ring attention (ring=True, `--ring`)" in err and "[16] not tried" in err
    out = _simulate_json(capsys, *args, "--ring")
    assert out["shard_size"] == 16 and out["shard_size_auto"] is True
    dcp = out["policies"]["dcp"]
    assert dcp["memory_violations"] == 0 and dcp["samples_dropped"] == 0
    assert any(w.startswith("SP 16 = ") for w in dcp["ring_splits"]), dcp["ring_splits"]


def test_simulate_an_explicit_shard_size_and_refuse_a_bad_one(capsys):
    out = _simulate_json(
        capsys,
        "--model",
        "wan-14b",
        "--world",
        "16",
        "--shard-size",
        "4",
        "--max-steps",
        "1",
        "--tokens-per-step",
        str(2**20),
        "--policy",
        "dcp",
    )
    assert out["shard_size"] == 4 and out["shard_size_auto"] is False and out["scenario"] == "video"
    from dcparallel.apps.cli import main

    assert main(["simulate", "--model", "llama-8b", "--world", "16", "--shard-size", "3", "--json"]) == 2
    assert "shard_size=3 must be a power of two" in capsys.readouterr().err


def test_simulate_from_a_profile_at_a_shard_size(tmp_path, capsys):
    from tests.unit.test_cost import _profile

    prof, lengths = tmp_path / "p.json", tmp_path / "lengths.txt"
    prof.write_text(json.dumps(_profile()))
    lengths.write_text("\n".join(str(600 + 37 * i) for i in range(40)))
    common = [
        "--profile",
        str(prof),
        "--lengths",
        str(lengths),
        "--world",
        "2",
        "--gpus-per-node",
        "2",
        "--policy",
        "dcp",
    ]
    one = _simulate_json(capsys, *common)
    two = _simulate_json(capsys, *common, "--shard-size", "2")
    assert one["shard_size"] == 1 and two["shard_size"] == 2
    assert two["model_state_bytes"] < one["model_state_bytes"]  # tiny model: the states shrink
    assert two["policies"]["dcp"]["memory_violations"] == 0 and two["policies"]["dcp"]["samples_dropped"] == 0
    # a profile measured at shard size 2 plans only 2: auto takes it
    measured = tmp_path / "p2.json"
    measured.write_text(json.dumps({**_profile(), "shard_size": 2}))
    auto = _simulate_json(capsys, *common[:1], str(measured), *common[2:], "--shard-size", "auto")
    assert auto["shard_size"] == 2 and auto["model_state_bytes"] == 1000


def test_simulate_a_transformers_config_built_on_the_meta_device(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg.to_dict()))
    import torch

    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.LlamaForCausalLM(cfg).parameters())
    # q (256 x 256), k, v (256 x 64), o; gate, up, down (256 x 688); two norms; embeddings, head, final norm
    assert expected == 4 * (2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 688 + 2 * 256) + 2 * 1000 * 256 + 256
    out = _simulate_json(
        capsys,
        "--model-config",
        str(path),
        "--world",
        "8",
        "--shard-size",
        "2",
        "--max-steps",
        "1",
        "--tokens-per-step",
        str(2**18),
        "--policy",
        "dcp",
    )
    assert out["model"] == "tiny" and out["num_params"] == expected and out["shard_size"] == 2


def test_the_text_presets_match_transformers_models_built_on_the_meta_device(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dcparallel.apps.model_config import spec_from_config

    configs = {
        "llama-8b": transformers.LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
        "llama-70b": transformers.LlamaConfig(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
        "qwen-32b": transformers.Qwen2Config(
            hidden_size=5120,
            intermediate_size=27648,
            num_hidden_layers=64,
            num_attention_heads=40,
            num_key_value_heads=8,
            vocab_size=152064,
            tie_word_embeddings=False,
        ),
    }
    for name, cfg in configs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg.to_dict()))
        got = spec_from_config(path, name=name)
        assert dataclasses.replace(got, name=name) == MODEL_PRESETS[name], name


def test_the_video_presets_match_diffusers_models_built_on_the_meta_device(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    import torch

    from dcparallel.apps.model_config import spec_from_config

    wan = dict(
        _class_name="WanTransformer3DModel",
        patch_size=[1, 2, 2],
        num_attention_heads=40,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=13824,
        num_layers=40,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    )
    path = tmp_path / "wan.json"
    path.write_text(json.dumps(wan))
    assert spec_from_config(path, name="wan-14b") == MODEL_PRESETS["wan-14b"]
    with torch.device("meta"):
        hv = diffusers.HunyuanVideoTransformer3DModel()
    preset = MODEL_PRESETS["hunyuanvideo-13b"]
    assert preset.num_params == sum(p.numel() for p in hv.parameters())
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert preset.max_unit_params == max(count(b) for b in [*hv.transformer_blocks, *hv.single_transformer_blocks])
    # HunyuanVideo has an adapter (joint attention): its config plans with exact counts
    hv_path = tmp_path / "hv.json"
    hv_path.write_text(json.dumps({"_class_name": "HunyuanVideoTransformer3DModel"}))
    spec = spec_from_config(hv_path)
    assert (spec.num_params, spec.max_unit_params) == (preset.num_params, preset.max_unit_params)
    # a config dcparallel has no adapter for is refused by name
    no_adapter = tmp_path / "allegro.json"
    no_adapter.write_text(json.dumps({"_class_name": "AllegroTransformer3DModel"}))
    with pytest.raises(ValueError, match="no adapter for AllegroTransformer3DModel"):
        spec_from_config(no_adapter)
