"""The planners with ring attention on (`ClusterSpec.ring`): the sizes they are offered past
the head count, the (Ulysses, ring) split each micro-batch gets (`plan.splits`) following the
links, `simulate` planning a 1M-token Llama-8B sample and long Wan 14B videos past their
heads and showing u x r, `megatron-dcp` going past the heads the same way; a `ProfiledCost`
pricing sizes past the heads at their measured split; `DataCentricParallel(ring=True)`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dcparallel.apps.cli import main
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.base import mb_time
from dcparallel.cost.forward import ForwardOnlyCost
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import NoLayoutFits
from dcparallel.scenarios import MODEL_PRESETS
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import STDIT_1B, ClusterSpec, Layout, Workload, h200_cluster
from tests.support import TWO_HEADS, two_head_profile

LLAMA_8B = MODEL_PRESETS["llama-8b"]  # 32 query heads, 8 key/value heads
WAN_14B = MODEL_PRESETS["wan-14b"]  # 40 heads


def _plan(model, cluster, sizes, policy="dcp"):
    """One step of every sample, planned by ``policy``: (plan, its predicted seconds)."""
    ctx = PlanContext(Workload(model, tuple(sizes)), AnalyticCost(model, cluster), cluster)
    step = Step(0, tuple(range(len(sizes))))
    plan = make_planner(policy, ctx, [step], score=step_seconds(ctx)).plan(step)
    return plan, step_seconds(ctx)(plan)


def _busy(plan):
    return [mb.layout for mb in plan.micro_batches()]


def _pcie(world: int, ring: bool = True):
    """One node of GPUs on PCIe-class links (25 GB/s, 20 us) instead of NVLink."""
    return dataclasses.replace(h200_cluster(world, world), intra_bw=25e9, intra_latency=20e-6, name="pcie", ring=ring)


def test_ring_offers_sizes_past_the_heads_only_when_asked():
    sizes = (1 << 20,)
    off = PlanContext(Workload(LLAMA_8B, sizes), AnalyticCost(LLAMA_8B, h200_cluster(128)), h200_cluster(128))
    on_cluster = dataclasses.replace(h200_cluster(128), ring=True)
    on = PlanContext(Workload(LLAMA_8B, sizes), AnalyticCost(LLAMA_8B, on_cluster), on_cluster)
    assert off.sp_sizes == [1, 2, 4, 8, 16, 32] and on.sp_sizes == [1, 2, 4, 8, 16, 32, 64, 128]
    # u dividing the heads: inside a node, or whole nodes
    assert on.topology.splits(64) == [(1, 64), (2, 32), (4, 16), (8, 8), (16, 4), (32, 2)]


@pytest.mark.parametrize("policy", ["dcp", "megatron-dcp"])
def test_the_split_follows_the_link_speed(policy):
    """A 128k-token sample on one 8-GPU node, heads allowing Ulysses 8: over PCIe-class links
    the planner runs it under ring (Ulysses' all-to-alls lie bare there, the ring's sends
    hide under the block attention) and predicts it faster than Ulysses alone; over NVLink
    the same sample runs Ulysses 8."""
    sample = [131072]
    pcie, t_pcie = _plan(LLAMA_8B, _pcie(8), sample, policy)
    ulysses, t_ulysses = _plan(LLAMA_8B, _pcie(8, ring=False), sample, policy)
    nvlink, _ = _plan(LLAMA_8B, dataclasses.replace(h200_cluster(8), ring=True), sample, policy)
    assert [(lay.sp, lay.ring > 1) for lay in _busy(pcie)] == [(8, True)], _busy(pcie)
    assert [(lay.sp, lay.ring) for lay in _busy(ulysses)] == [(8, 1)]
    assert t_pcie < 0.95 * t_ulysses, (t_pcie, t_ulysses)  # 5.45 s against 6.04 s
    assert [(lay.sp, lay.ring) for lay in _busy(nvlink)] == [(8, 1)], _busy(nvlink)


@pytest.mark.parametrize("forward_only", [False, True], ids=["training", "forward-only"])
def test_the_split_set_is_the_one_priced(forward_only):
    """Every micro-batch of a mixed step runs the split its time was priced at (`terms` price
    each micro-batch at `best_split`'s split): its layout's ring degree is `best_split`'s for
    its samples; forward-only passes (`ForwardOnlyCost`) take their training terms' split."""
    cluster = dataclasses.replace(h200_cluster(64), ring=True)
    sizes = [1 << 20, 300_000] + [4096 * (1 + i % 8) for i in range(60)]
    cost = AnalyticCost(LLAMA_8B, cluster)
    ctx = PlanContext(Workload(LLAMA_8B, tuple(sizes)), ForwardOnlyCost(cost) if forward_only else cost, cluster)
    step = Step(0, tuple(range(len(sizes))))
    plan = make_planner("dcp", ctx, [step], score=step_seconds(ctx)).plan(step)
    rings = set()
    for mb in plan.micro_batches():
        best = cost.best_split([ctx.sizes[i] for i in mb.sample_ids], mb.layout.sp)
        assert (mb.layout.ulysses, mb.layout.ring) == (best.ulysses, best.ring)
        rings.add(mb.layout.ring)
    assert max(rings) > 1
    plan.validate(64)


def test_a_factorized_video_model_is_refused_under_ring():
    with pytest.raises(ValueError, match=r"factorized spatial / temporal attention cannot run under ring.*ring=False"):
        AnalyticCost(STDIT_1B, dataclasses.replace(h200_cluster(16), ring=True))


def _simulate(capsys, tmp_path, lines, *args) -> dict:
    path = tmp_path / "lengths.txt"
    path.write_text("".join(f"{x}\n" for x in lines))
    assert main(["simulate", "--lengths", str(path), "--json", "--quiet", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("world", [64, 128])
def test_simulate_plans_a_1m_token_llama_8b_sample_past_its_32_heads(capsys, tmp_path, world):
    out = _simulate(
        capsys, tmp_path, [1 << 20], "--model", "llama-8b", "--world", str(world), "--ring", "--policy", "dcp"
    )
    splits = out["policies"]["dcp"]["ring_splits"]
    # one micro-batch, on 64 ranks at 64 GPUs and on all 128 at 128 (its step has nothing else)
    assert splits == {f"SP {world} = 8u×{world // 8}r": 1}, splits


def test_plan_prints_the_split(capsys, tmp_path):
    path = tmp_path / "one.txt"
    path.write_text(f"{1 << 20}\n")
    assert (
        main(["plan", "--model", "llama-8b", "--lengths", str(path), "--world", "64", "--ring", "--policy", "dcp"]) == 0
    )
    assert "1 sample at SP 64 = 8u×8r, recompute" in capsys.readouterr().out


@pytest.mark.parametrize(("world", "video"), [(16, (321, 1088, 1920)), (32, (641, 1088, 1920))])
def test_wan_14b_videos_too_long_for_its_head_limit_run_at_sp_16_and_32(world, video):
    """Wan 14B's 40 heads allow Ulysses at 1, 2, 4, 8 (and 40): a 653k-token video needs
    more than 8 ranks, a 1.3M-token one more than 16. Without ring neither fits; with ring
    they run at the whole world, u x r."""
    with pytest.raises(NoLayoutFits, match="fits no layout"):
        _plan(WAN_14B, h200_cluster(world), [video])
    plan, _ = _plan(WAN_14B, dataclasses.replace(h200_cluster(world), ring=True), [video])
    (lay,) = _busy(plan)
    assert lay.sp == world and lay.ring > 1 and 40 % lay.ulysses == 0, lay


def test_dcp_is_at_least_as_fast_as_megatron_dcp_with_ring_on_a_long_mix(capsys, tmp_path):
    """megatron-dcp's CP goes past the heads through ring as Megatron's does (its levels are
    the ring topology's sizes, each micro-batch at its best split), so both policies plan
    with the same sizes and prices; dcp's plans are predicted no slower."""
    lines = [1 << 20, 700_000, 400_000] + [2048 << (i % 6) for i in range(150)]
    out = _simulate(
        capsys,
        tmp_path,
        lines,
        "--model",
        "llama-8b",
        "--world",
        "64",
        "--ring",
        "--tokens-per-step",
        "3000000",
        "--policy",
        "dcp",
        "--policy",
        "megatron-dcp",
    )
    dcp, meg = out["policies"]["dcp"], out["policies"]["megatron-dcp"]
    assert max(int(w.split()[1]) for w in meg["ring_splits"]) == 64  # megatron-dcp went past 32 heads
    assert dcp["epoch_time_s"] <= meg["epoch_time_s"], (dcp["epoch_time_s"], meg["epoch_time_s"])


def _two_head_profile() -> Profile:
    """A profile of a 2-head model at world 4 as `prepare` with ring measures it: SP 1 and 2
    Ulysses, SP 4 (past the heads) at its measured split, Ulysses 2 x ring 2; the
    4000-token bucket does not fit one or two ranks."""
    entries = []
    for key, tok in (("t500", 500), ("t4000", 4000)):
        for sp in (1, 2, 4):
            for mode, tf, mf in (("none", 1.0, 1.0), ("full", 1.3, 0.2)):
                fits = tok < 4000 or sp == 4
                entries.append(
                    {
                        "bucket": key,
                        "sp": sp,
                        "mbs": 1,
                        "recompute": mode,
                        "time_s": 1e-3 * tok / sp * tf + 0.01 * (sp == 4),
                        "memory_bytes": 100.0 * tok / sp * mf,
                        "feasible": fits,
                        **({} if fits else {"reason": "over_budget"}),
                    }
                )
    return two_head_profile(entries)


def test_a_profiled_cost_prices_sizes_past_the_heads_at_their_measured_split():
    """With ring, a `ProfiledCost` prices SP 4 of a 2-head model from the profile's SP 4
    measurements, names Ulysses 2 x ring 2 as its split (ring 1 at SP 2), and the plans run
    the 4000-token sample there; without ring SP 4 is not offered."""
    ring = ClusterSpec(world_size=4, gpus_per_node=4, memory_bytes=10**6, ring=True)
    cost = ProfiledCost(_two_head_profile(), ring)
    assert cost.sp_sizes == [1, 2, 4]
    assert (cost.best_split((4000,), 4).ulysses, cost.best_split((4000,), 4).ring) == (2, 2)
    assert (cost.best_split((500,), 2).ulysses, cost.best_split((500,), 2).ring) == (2, 1)
    assert mb_time(cost, [4000], Layout(4, 1)) == pytest.approx(1.0 + 0.01)  # the measured time
    sizes = (4000, 500, 500, 500)
    ctx = PlanContext(Workload(TWO_HEADS, sizes), cost, ring)
    step = Step(0, tuple(range(len(sizes))))
    plan = make_planner("dcp", ctx, [step], score=step_seconds(ctx)).plan(step)
    wide = [mb for mb in plan.micro_batches() if 0 in mb.sample_ids]
    assert [(mb.layout.sp, mb.layout.ring) for mb in wide] == [(4, 2)]
    off = dataclasses.replace(ring, ring=False)
    assert PlanContext(Workload(TWO_HEADS, (500,)), ProfiledCost(_two_head_profile(), off), off).sp_sizes == [1, 2]
    with pytest.raises(ValueError, match="an SP group of 3 ranks is not allowed"):
        cost.best_split((500,), 3)


def test_the_wrapper_turns_ring_on_for_its_groups_and_plans():
    """``DataCentricParallel(ring=True)``: the ClusterSpec it plans and prices with and its
    engine's process groups carry ring; off by default; a non-boolean is refused."""
    from dcparallel.api import DataCentricParallel
    from tests.support import make_model

    with pytest.raises(ValueError, match="ring='yes': give True"):
        DataCentricParallel(make_model("llama"), ring="yes")
    dc = DataCentricParallel(make_model("llama"), ring=True)
    assert dc.cluster_spec.ring and dc.groups.topology.ring
    assert not DataCentricParallel(make_model("llama")).cluster_spec.ring
