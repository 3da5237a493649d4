"""Cost models: the analytic fit against the H200 calibration rows, its monotonicity, and
ProfiledCost over a hand-made profile."""

import dataclasses
import json

import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.base import grad_sync_time, mb_memory, mb_time, model_state_bytes, state_recipe
from dcparallel.cost.calibration_fit import _load, _shape, fit_calibration
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile, ProfileBucket, ProfileEntry
from dcparallel.spec import LLAMA_7B, STDIT_1B, ClusterSpec, Layout, Recompute, h200_cluster

from ._models import TINY_LM, cluster


def _one_layer(model):
    return dataclasses.replace(model, num_layers=1, vocab_size=0, extra_params=0)


def test_llama_fit_reproduces_calibration_rows():
    """The fitted 7B block predicts every measured layer row (L = 512..131072, recompute
    off and on) within 25% and on average within 10%; its saved activations within 2%."""
    c = AnalyticCost(_one_layer(LLAMA_7B), ClusterSpec(world_size=1, gpus_per_node=1))
    rows = [r for r in _load("h200_blocks.jsonl") if r["kind"] == "layer" and r["cfg"] == "llama-7b-block"]
    t_err, m_err = [], []
    for r in rows:
        terms = c.terms([r["L"]], 1)
        rc = Recompute(1, 1) if r["recompute"] else Recompute()
        t_err.append(abs(terms.time(rc) / r["fwdbwd_s"] - 1))
        kept = terms.act_layer - (terms.save_full if r["recompute"] else 0)
        m_err.append(abs(kept / r["saved_act_bytes"] - 1))
    big = [e for e, r in zip(t_err, rows) if r["L"] >= 4096]  # compute-bound rows
    assert max(big) < 0.25 and sum(t_err) / len(t_err) < 0.10
    assert max(m_err) < 0.02


def test_stdit_fit_reproduces_bucket_rows():
    c = AnalyticCost(_one_layer(STDIT_1B), ClusterSpec(world_size=1, gpus_per_node=1))
    rows = [r for r in _load("h200_stdit_buckets.jsonl") if r["kind"] == "stdit" and not r["recompute"]]
    errs = [abs(c.terms([_shape(r)] * r["bs"], 1).time(Recompute()) / r["fwdbwd_s"] - 1) for r in rows]
    assert sum(errs) / len(errs) < 0.10 and max(errs) < 0.30
    cal = fit_calibration("stdit-1.1b")
    assert cal.time_err_mean < 0.10


def test_analytic_monotone_in_tokens_sp_and_recompute():
    cl = h200_cluster(32)
    c = AnalyticCost(LLAMA_7B, cl)
    L = LLAMA_7B.num_layers
    lay = Layout(1, 1)
    assert mb_time(c, [8192], lay) < mb_time(c, [16384], lay) < mb_time(c, [65536], lay)
    # SP splits work and activations: per-rank memory falls, time falls for long sequences
    assert mb_memory(c, [65536], Layout(4, 1)) < mb_memory(c, [65536], Layout(1, 1))
    assert mb_time(c, [65536], Layout(4, 1)) < mb_time(c, [65536], Layout(1, 1))
    # recomputation trades time for memory, MLP-only saves memory cheaper per second (calibration README)
    full, none = Layout(1, 1, Recompute(L, L)), Layout(1, 1)
    assert mb_memory(c, [32768], full) < mb_memory(c, [32768], none)
    assert mb_time(c, [32768], full) > mb_time(c, [32768], none)
    t = c.terms([32768], 1)
    assert t.save_mlp / t.dt_mlp > t.save_attn / t.dt_attn


def test_groups_spanning_nodes_pay_the_inter_node_link():
    cl = h200_cluster(32)
    c = AnalyticCost(LLAMA_7B, cl)
    per_rank = lambda k: mb_time(c, [131072], Layout(k, 1)) * k  # GPU-seconds
    assert per_rank(16) / per_rank(8) > per_rank(8) / per_rank(4)


def test_model_state_and_grad_sync():
    assert model_state_bytes(LLAMA_7B, 32) == LLAMA_7B.num_params * (6 + 12 / 32)
    one = grad_sync_time(LLAMA_7B, h200_cluster(8))
    four = grad_sync_time(LLAMA_7B, h200_cluster(32))
    assert 0 < one < four
    assert grad_sync_time(LLAMA_7B, h200_cluster(1, 1)) == 0.0


def test_zero1_sync_is_priced_as_reduce_scatter_plus_parameter_all_gather():
    """ZeRO-1 reduces each gradient bucket into its shard's owner (a reduce-scatter in all)
    and all-gathers the updated parameters: half an all-reduce of the fp32 gradients plus half
    one of the parameters in their dtype, less than the all-reduce of the fp32 gradients."""
    from dcparallel.cost.base import allreduce_time

    c = h200_cluster(32)
    t = LLAMA_7B.trainable_params
    full = allreduce_time(c, 4.0 * t)
    zero1 = grad_sync_time(LLAMA_7B, c)
    assert zero1 == pytest.approx(full / 2 + allreduce_time(c, LLAMA_7B.bytes_per_value * t) / 2)
    assert zero1 < full


def _profile() -> dict:
    cl = cluster(2, 2)
    entries = []
    for key, tok in (("t1000", 1000), ("t4000", 4000)):
        for sp in (1, 2):
            for mbs in (1, 2):
                for mode, tf, mf in (("none", 1.0, 1.0), ("attn", 1.1, 0.7), ("mlp", 1.05, 0.6), ("full", 1.3, 0.1)):
                    t = 0.001 * tok / sp * mbs * tf
                    m = 100.0 * tok / sp * mbs * mf
                    entries.append(
                        {
                            "bucket": key,
                            "sp": sp,
                            "mbs": mbs,
                            "recompute": mode,
                            "time_s": t,
                            "memory_bytes": m,
                            "feasible": True,
                        }
                    )
    prof = Profile(
        fingerprint={"world_size": 2},
        model=TINY_LM,
        world_size=2,
        gpus_per_node=2,
        model_state_bytes=1000.0,
        grad_sync_s=0.01,
        buckets=[{"key": "t1000", "size": 1000, "tokens": 1000}, {"key": "t4000", "size": 4000, "tokens": 4000}],
        entries=entries,
    )
    assert cl.world_size == 2
    return prof.to_json()


def test_profiled_cost_exact_and_interpolated(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile()))
    c = ProfiledCost(Profile.load(path), cluster(2, 2))
    L = TINY_LM.num_layers
    # measured points come back exactly
    assert mb_time(c, [1000], Layout(1, 1)) == pytest.approx(1.0)
    assert mb_memory(c, [4000, 4000], Layout(2, 2)) == pytest.approx(1000 + 100 * 2000 * 2)
    assert mb_time(c, [4000], Layout(1, 1, Recompute(L, L))) == pytest.approx(4.0 * 1.3)
    assert mb_memory(c, [4000], Layout(1, 1, Recompute(0, L))) == pytest.approx(1000 + 400000 * 0.6)
    # between buckets: linear in tokens; partial recompute: linear in layers
    assert mb_time(c, [2500], Layout(1, 1)) == pytest.approx(2.5)
    half = mb_memory(c, [1000], Layout(1, 1, Recompute(0, L // 2)))
    assert half == pytest.approx(1000 + 100000 * 0.8)
    # a micro-batch larger than measured scales proportionally
    assert mb_time(c, [1000] * 4, Layout(1, 4)) == pytest.approx(4.0)
    assert c.sp_sizes == [1, 2] and c.grad_sync_time() == 0.01


def test_larger_micro_batches_pay_the_fixed_cost_once():
    """Beyond the largest measured micro-batch, each more sample costs the marginal time
    between the last two measurements: a micro-batch's fixed cost (launches, all-to-all
    latency) is not multiplied. Here t(m) = 0.2 + 0.8 m s, memory 50 + 10 m bytes."""
    d = _profile()
    for e in d["entries"]:
        if e["bucket"] == "t1000" and e["sp"] == 1 and e["recompute"] == "none":
            e["time_s"], e["memory_bytes"] = 0.2 + 0.8 * e["mbs"], 50.0 + 10.0 * e["mbs"]
    c = ProfiledCost(Profile.from_json(d), cluster(2, 2))
    assert mb_time(c, [1000] * 2, Layout(1, 2)) == pytest.approx(1.8)  # measured
    assert mb_time(c, [1000] * 8, Layout(1, 8)) == pytest.approx(0.2 + 0.8 * 8)  # not 8 x 0.9
    assert mb_memory(c, [1000] * 8, Layout(1, 8)) == pytest.approx(1000 + 50 + 10 * 8)


def test_profile_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read profile"):
        Profile.load(bad)
    d = _profile()
    d["version"] = 99
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="version 99"):
        Profile.load(bad)
    d = _profile()
    del d["model"]["hidden"]
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="corrupt"):
        Profile.load(bad)
    with pytest.raises(ValueError, match="no measurement at sp=4"):
        ProfiledCost(Profile.from_json(_profile()), cluster(2, 2)).terms([1000], 4)


def test_a_profile_prices_only_the_world_size_it_measured():
    """SP groups and the gradient sync of another world size were never measured."""
    with pytest.raises(ValueError, match="measured at world size 2 but the cluster has 4 ranks"):
        ProfiledCost(Profile.from_json(_profile()), cluster(4, 4))


def test_the_typed_profile_round_trips_through_json():
    p = Profile.from_json(_profile())
    assert all(isinstance(b, ProfileBucket) for b in p.buckets) and all(isinstance(e, ProfileEntry) for e in p.entries)
    assert p.buckets[1].key == "t4000" and p.buckets[1].tokens == 4000
    again = Profile.from_json(json.loads(json.dumps(p.to_json())))
    assert again == p and again.to_json() == p.to_json()


def test_profile_with_only_full_recompute_feasible():
    d = _profile()
    for e in d["entries"]:
        if e["bucket"] == "t4000" and e["recompute"] != "full":
            e.update(feasible=False, time_s=None, memory_bytes=None)
    d["buckets"] = [b for b in d["buckets"] if b["key"] == "t4000"]
    d["entries"] = [e for e in d["entries"] if e["bucket"] == "t4000"]
    c = ProfiledCost(Profile.from_json(d), cluster(2, 2))
    L = TINY_LM.num_layers
    assert mb_memory(c, [4000], Layout(1, 1)) == float("inf")
    assert mb_memory(c, [4000], Layout(1, 1, Recompute(L, L))) == pytest.approx(1000 + 40000)
    assert c.terms([4000], 1).cheapest_recompute(1e9) == Recompute(L, L)


def test_analytic_cost_needs_link_speeds():
    with pytest.raises(ValueError, match="no link bandwidth"):
        AnalyticCost(LLAMA_7B, ClusterSpec(world_size=16, gpus_per_node=8))
    AnalyticCost(LLAMA_7B, ClusterSpec(world_size=1, gpus_per_node=1))  # one GPU: nothing to price


def test_a_sample_shorter_than_the_smallest_bucket_keeps_its_fixed_cost():
    """Below the smallest bucket a sample's time follows the line through the two smallest
    buckets (here t = 0.5 s + 0.5 ms per token: a 500-token sample costs 0.75 s, not the
    proportional 0.5 s), the same share at every micro-batch size, and never below
    proportional (a steeper line, from noise, would price a short sample at nothing)."""
    d = _profile()
    for e in d["entries"]:
        if e["sp"] == 1 and e["recompute"] == "none" and e["mbs"] == 1:
            e["time_s"] = 0.5 + 0.0005 * int(e["bucket"][1:])
    c = ProfiledCost(Profile.from_json(d), cluster(2, 2))
    assert mb_time(c, [500], Layout(1, 1)) == pytest.approx(0.75)
    assert mb_time(c, [100], Layout(1, 1)) == pytest.approx(0.55)
    assert mb_time(c, [500, 500], Layout(1, 2)) == pytest.approx(2.0 * 0.75)  # 2 x (mbs-2 time per sample 1.0 x share)
    times = [mb_time(c, [k], Layout(1, 1)) for k in range(1, 1001, 37)]
    assert times == sorted(times)  # never cheaper for more tokens
    for e in d["entries"]:
        if e["bucket"] == "t4000" and e["sp"] == 1 and e["recompute"] == "none" and e["mbs"] == 1:
            e["time_s"] = 10.0
    steep = ProfiledCost(Profile.from_json(d), cluster(2, 2))
    assert mb_time(steep, [500], Layout(1, 1)) == pytest.approx(0.5 * 1.0)  # proportional floor


def test_llama_7b_recipe_at_world_8_leaves_80gb_cards_room_for_activations():
    """ZeRO-1 at W = 8 in bf16: 2 + 4 + 12/8 = 7.5 bytes a parameter (50.5 GB for 6.74B), the
    step's peak one 16 MiB chunk more, so an 80 GB card keeps 29.5 GB for activations (the
    runtime's measured bytes: tests/dist/test_dist_step_memory.py)."""
    r = state_recipe(LLAMA_7B, 8, 1)
    p = LLAMA_7B.num_params
    assert r.states == model_state_bytes(LLAMA_7B, 8) == pytest.approx(p * 7.5)
    assert r.step_peak - r.states == 4 * 2**22  # the update's one chunk of fp32 temporaries
    left = 80e9 - max(r.states, r.step_peak)
    assert 29e9 < left < 30e9
    cl = h200_cluster(world_size=8, gpus_per_node=8, memory_bytes=80 * 10**9)
    assert AnalyticCost(LLAMA_7B, cl).model_state_bytes() == r.states


def test_sharded_recipe_states_its_step_transients():
    """Shard blocks: fp32 shards 8 / s bytes a parameter, moments 8 / W, the gathered layer
    during micro-batches only, and the step's 1 + W/s chunks."""
    r = state_recipe(LLAMA_7B, 16, 8)
    p = LLAMA_7B.num_params
    assert r.params + r.grads == pytest.approx(8 * p / 8) and r.optimizer == pytest.approx(8 * p / 16)
    assert r.step_transient == 3 * 4 * 2**22 and r.states - r.step_peak == r.gathered - r.step_transient
