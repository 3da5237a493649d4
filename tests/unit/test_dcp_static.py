"""`dcp` never loses to a static layout it could have offered (`plan/dcp/static.py`): over
models from a few million parameters to 70B, text and video, on heavy-tailed mixes, its
simulated epoch is within 1% of the tuned `bucket` and `packed` baselines' (in fact never
slower on any step: their plans are among its candidates). And `simulate` warns when another
policy beats the chosen one.

The small models are the launch-bound regime: a 7M-parameter Llama on a code corpus of 67 to
191k tokens per file, where the class level's per-class micro-batches of one or two short
files cost far more than one packed bin per group."""

import argparse
import dataclasses

import numpy as np
import pytest

from benchmarks.tight_bound import build_cell
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.auto_shard import auto_shard_size
from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import MODEL_PRESETS, SCENARIOS, TextMix, decoder_lm, sample_sizes
from dcparallel.sim.run import plan_epoch
from dcparallel.spec import ModelSpec, Workload, h200_cluster

#: a 7M-parameter Llama: 4 layers, hidden 256, 8 heads, vocabulary 8192
LLAMA_7M = decoder_lm(
    "llama-7m", num_layers=4, hidden=256, num_heads=8, num_kv_heads=8, ffn_hidden=688, vocab_size=8192
)
#: a 6M-parameter DiT (4 blocks of hidden 256, 16-pixel tokens through a 4x / 8x VAE)
DIT_6M = ModelSpec(
    name="dit-6m",
    kind="video",
    num_layers=4,
    hidden=256,
    num_heads=8,
    ffn_hidden=1024,
    attention="full",
    attn_params=4 * 256 * 256,
    mlp_params=2 * 256 * 1024,
    other_params=4 * 256,
    extra_params=1_000_000,
    context_tokens=128,
    t_num=1,
    t_den=4,
    spatial_patch=16,
)
#: source files of a code corpus: log-normal around 1.3k tokens, 67 to 191k tokens a file
CODE = TextMix(median=1300, sigma=1.5, tail_share=0.0, tail_min=1, tail_alpha=1.0, max_tokens=191_000, min_tokens=67)


def code_files(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(CODE.draw(np.random.default_rng(seed), n))


def _mix(model: ModelSpec, mix: str, n: int) -> tuple:
    if mix == "code":
        return code_files(n)
    return tuple(sample_sizes(model.kind, mix, num_samples=n))


# (model, mix, samples, world, tokens per step): launch-bound small models to 70B
CASES = [
    (LLAMA_7M, "code", 767, 2, 2**18),
    (LLAMA_7M, "code", 767, 8, 2**18),
    (LLAMA_7M, "sft-long", 600, 4, 2**19),
    (DIT_6M, "video-mix", 300, 4, 2**20),
    # steps of about 4,800 images, above the static layouts' gate: dcp's own micro-batches of
    # hundreds of small images (`context.MAX_COPIES`), as packed's bins hold
    (DIT_6M, "image-buckets", 10000, 8, 2**24),
    (MODEL_PRESETS["llama-8b"], "code", 767, 8, 2**20),
    (SCENARIOS["video"].model, "video-mix", 400, 8, 2**22),
    (MODEL_PRESETS["llama-70b"], "pretrain-long", 300, 16, 2**21),
    (MODEL_PRESETS["wan-14b"], "video-wide", 300, 16, 2**22),
]


def epoch_seconds(model: ModelSpec, sizes: tuple, world: int, tokens_per_step: int, max_steps: int = 4) -> dict:
    """Each policy's simulated seconds over the first ``max_steps`` steps, at the smallest
    shard size that fits (as `simulate --shard-size auto`)."""
    cluster = h200_cluster(world, min(world, 8))
    cluster = dataclasses.replace(cluster, shard_size=auto_shard_size(model, cluster, sizes))
    ctx = PlanContext(Workload(model, sizes), AnalyticCost(model, cluster), cluster)
    steps = form_steps(ctx.workload.tokens, seed=0, tokens_per_step=tokens_per_step)[:max_steps]
    return {p: plan_epoch(ctx, steps, p).sim.total_time for p in ("dcp", "bucket", "packed")}


@pytest.mark.parametrize("model,mix,n,world,tps", CASES, ids=[f"{c[0].name}-{c[1]}-w{c[3]}" for c in CASES])
def test_dcp_is_never_more_than_one_percent_behind_a_static_layout(model, mix, n, world, tps):
    got = epoch_seconds(model, _mix(model, mix, n), world, tps)
    assert got["dcp"] <= 1.01 * min(got["bucket"], got["packed"]), got


def test_the_small_model_case_is_launch_bound():
    """The regime the static candidates exist for: on the 7M Llama the class level alone (no
    static candidates) is far slower than `packed`, so the test above would fail without them."""
    from dcparallel.plan.dcp.portfolio import DcpPlanner
    from dcparallel.plan.policies import make_planner
    from dcparallel.sim.replay import step_seconds

    cluster = h200_cluster(8, 8)
    ctx = PlanContext(Workload(LLAMA_7M, code_files(767)), AnalyticCost(LLAMA_7M, cluster), cluster)
    steps = form_steps(ctx.workload.tokens, seed=0, tokens_per_step=2**18)[:3]
    score = step_seconds(ctx)
    alone, packed = DcpPlanner(ctx, score), make_planner("packed", ctx, steps, score=score)
    dcp = make_planner("dcp", ctx, steps, score=score)
    for s in steps:
        assert score(alone.plan(s)) > 1.5 * score(packed.plan(s))
        assert score(dcp.plan(s)) <= score(packed.plan(s))
    assert dcp.describe()["kept_by"].get("packed", 0) > 0


def _simulate_args(world: int, policies: list[str], lengths) -> argparse.Namespace:
    return argparse.Namespace(
        scenario=None,
        distribution=None,
        lengths=lengths,
        world=world,
        gpus_per_node=8,
        seed=0,
        tokens_per_step=2**18,
        profile=None,
        model=None,
        model_config=None,
        shard_size=1,
        max_steps=3,
        policy=policies,
        all=False,
        json=False,
        quiet=True,
    )


def test_simulate_warns_when_another_policy_beats_the_chosen_one(tmp_path, capsys, monkeypatch):
    from dcparallel.apps import simulate as app

    lengths = tmp_path / "code.txt"
    lengths.write_text("\n".join(map(str, code_files(767))) + "\n")
    monkeypatch.setattr(app, "_model_of", lambda args: LLAMA_7M)  # the 7M Llama, not built from a config
    app.cmd_simulate(_simulate_args(8, ["bucket", "packed"], lengths))
    warned = capsys.readouterr().err
    app.cmd_simulate(_simulate_args(8, ["dcp", "bucket", "packed"], lengths))
    quiet = capsys.readouterr().err
    assert "warning: bucket is not the fastest policy here: packed is" in warned
    assert "warning" not in quiet


def test_static_layouts_are_offered_only_on_steps_of_few_samples():
    """Above `DcpConfig.static_max_samples` samples a step is not offered the static plans (their
    packing is Python work per sample), and they are tuned only on the steps they will meet."""
    from dcparallel.plan.dcp.candidate import StepFacts
    from dcparallel.plan.dcp.classlevel import ClassLevelPlanner
    from dcparallel.plan.dcp.static import static_layouts
    from dcparallel.plan.dcp.tables import LayoutTable
    from dcparallel.sim.replay import step_seconds

    cluster = h200_cluster(8, 8)
    ctx = PlanContext(Workload(LLAMA_7M, code_files(767)), AnalyticCost(LLAMA_7M, cluster), cluster)
    steps = form_steps(ctx.workload.tokens, seed=0, tokens_per_step=2**18)[:3]
    score = step_seconds(ctx)
    fewest = min(len(s.sample_ids) for s in steps)
    assert static_layouts(ctx, steps, score, max_samples=fewest - 1) == []
    got = static_layouts(ctx, steps, score, max_samples=fewest)
    assert [c.name for c in got] == ["bucket", "packed"]
    own = ClassLevelPlanner(LayoutTable(ctx)).class_plan(steps[0])
    for s in steps:
        standing = StepFacts(s, len(s.sample_ids), 8, own, own.bound, own.longest)
        assert all(c.runs(standing) == (len(s.sample_ids) <= fewest) for c in got)


def _video_cell(dist: str, world: int, budget: str):
    """A video cell's context and first 3 steps, as the scale report forms them."""
    tps = SCENARIOS["video"].tokens_per_step
    ctx, steps = build_cell("video", dist, world, tps * world // 32 if budget == "weak" else tps, 3)
    return ctx, steps[:3]


@pytest.mark.parametrize(
    "dist,world,budget", [("long", 64, "weak"), ("video-mix", 256, "strong"), ("short", 32, "weak")]
)
def test_a_static_plan_is_never_faster_than_its_floor(dist, world, budget):
    """`bucket` and `packed` at every static SP degree and recompute setting that fits, on real
    video steps: the simulator's step time of their plan is never below its floor
    (`plan/static_floor.py`), and the floor is within 30% of it on some (it is not vacuous)."""
    from dcparallel.plan.bucket import BucketPlanner
    from dcparallel.plan.packed import PackedPlanner
    from dcparallel.plan.types import NoLayoutFits
    from dcparallel.sim.replay import step_seconds
    from dcparallel.spec import STATIC_MODES

    ctx, steps = _video_cell(dist, world, budget)
    score, ratios = step_seconds(ctx), []
    for sp in ctx.topology.static_sizes(ctx.sp_sizes):
        for mode in STATIC_MODES:
            for make in (BucketPlanner, PackedPlanner):
                try:
                    planner = make(ctx, sp, mode)
                except NoLayoutFits:
                    continue
                for s in steps[:2]:
                    floor, got = planner.floor(s), score(planner.plan(s))
                    assert floor <= got, (make.name, sp, mode, floor, got)
                    ratios.append(floor / got)
    assert len(ratios) >= 8 and max(ratios) > 0.7, ratios


def test_the_floor_prices_a_steps_classes_in_one_grid_as_one_by_one():
    """A step's classes are priced in one grid (`StaticFloor.price`): each class's table equals
    its own `copies_times` call, element for element, on a strong 256-GPU video-mix step (58
    shapes), at every static degree of `bucket` and `packed` (attention recomputed)."""
    from dcparallel.plan.bucket import BucketPlanner
    from dcparallel.plan.packed import PackedPlanner
    from dcparallel.plan.static_floor import PRICED
    from dcparallel.plan.types import NoLayoutFits

    ctx, steps = _video_cell("video-mix", 256, "strong")
    keys, at = ctx.bucket_positions()
    held = sorted({keys[j] for j in at[np.asarray(steps[0].sample_ids)].tolist()})
    assert len(held) > 40
    checked = 0
    for sp in ctx.topology.static_sizes(ctx.sp_sizes):
        for make in (BucketPlanner, PackedPlanner):
            try:
                floor = make(ctx, sp, "attn").floor
            except NoLayoutFits:
                continue
            floor(steps[0])  # prices the step's classes at once
            for b in held:
                (alone,) = ctx.copies_times([ctx.rep[b]], [min(floor.most(b), PRICED)], sp, floor.mode)
                assert np.array_equal(floor.table(b)[1], alone), (make.name, sp, b)
                checked += 1
    assert checked >= 2 * len(held)


def _plans_counting_statics(dist: str, world: int, budget: str) -> tuple[list, list, list[str], list[str]]:
    """A cell's 3 steps planned by `dcp` with its static floors and with every floor 0, and
    the static layouts planned each time."""
    from dcparallel.plan.dcp import static as static_module
    from dcparallel.plan.policies import make_planner
    from dcparallel.sim.replay import step_seconds

    ctx, steps = _video_cell(dist, world, budget)
    planner = make_planner("dcp", ctx, steps, score=step_seconds(ctx))
    assert [c.name for c in planner.static] == ["bucket", "packed"]
    proposed: list[str] = []
    propose = static_module.StaticLayout.propose
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            static_module.StaticLayout, "propose", lambda self, s: proposed.append(self.name) or propose(self, s)
        )
        skipping = [planner.plan(s) for s in steps]
        with_floors = list(proposed)
        mp.setattr(static_module.StaticLayout, "floor", lambda self, s: 0.0)
        every = [planner.plan(s) for s in steps]
    return skipping, every, with_floors, proposed[len(with_floors) :]


@pytest.mark.parametrize("dist,world,budget", [("long", 1024, "weak"), ("image-buckets", 1024, "strong")])
def test_dcp_skips_the_static_plans_its_kept_plan_beats_and_plans_the_same(dist, world, budget):
    """Where the plan `dcp` keeps is already faster than a static layout's floor it does not
    plan that layout: on weak 1024-GPU video/long steps (about 1,200 clips) and strong ones of
    image buckets, neither baseline is planned, and the plans are those made with every floor
    0 (each static layout planned, then not kept)."""
    skipping, every, with_floors, without = _plans_counting_statics(dist, world, budget)
    assert with_floors == [] and len(without) == 2 * len(skipping)
    assert [p.to_json() for p in skipping] == [p.to_json() for p in every]
