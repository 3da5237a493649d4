"""`dcp`'s one-micro-batch-per-rank split (`plan/dcp/whole.py`) on real image-bucket steps
of about two images per GPU: a valid plan (every sample once, one latent shape and one group
per micro-batch, within memory) timed by the simulator as predicted; kept by `dcp` where it is
faster than the packing (at the step's bound at 128 GPUs, where `dcp` without it is 1.4%
above); declined where a rank could run two micro-batches or a class holds several sizes; its prices
made ahead by an epoch's planner, with the same plans."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from benchmarks.tight_bound import build_cell
from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.dcp.config import DEFAULT
from dcparallel.plan.dcp.portfolio import DcpPlanner, SamplePacking
from dcparallel.plan.dcp.sample import SamplePacker
from dcparallel.plan.dcp.whole import MAX_COPIES, WholeSplit
from dcparallel.plan.policies import make_planner
from dcparallel.scenarios import SCENARIOS
from dcparallel.sim.replay import simulate, step_seconds


def first_step(scenario: str, mix: str, world: int, div: int):
    ctx, steps = build_cell(scenario, mix, world, SCENARIOS[scenario].tokens_per_step // div, 2)
    return ctx, steps[0]


@pytest.fixture(scope="module")
def images():
    """The strong 1024-GPU image-bucket cell's budget over 8 at 128 GPUs: 2.3 images per GPU."""
    return first_step("video", "image-buckets", 128, 8)


def test_the_split_is_a_valid_plan_of_one_micro_batch_per_group(images):
    ctx, step = images
    split = WholeSplit(SamplePacker(ctx, "pac"))
    got = split.plan(list(step.sample_ids))
    assert got is not None
    plan = split.packer.step_plan(step, got.groups)
    plan.validate(128)
    busy = [g for g in plan.groups if g.micro_batches]
    assert all(len(g.micro_batches) == 1 for g in busy)
    assert sum(g.sp for g in busy) <= 128
    assert max(Counter(r for g in busy for r in g.ranks).values()) == 1
    mbs = list(plan.micro_batches())
    assert sorted(i for mb in mbs for i in mb.sample_ids) == sorted(step.sample_ids)
    assert all(len({ctx.bucket_of[i] for i in mb.sample_ids}) == 1 for mb in mbs)
    sim = simulate([plan], ctx)
    assert sim.memory_violations == 0
    assert sim.total_time == pytest.approx(got.span, rel=1e-9)


def test_dcp_keeps_the_split_where_it_beats_the_class_level_and_the_packing(images):
    ctx, step = images
    score = step_seconds(ctx)
    with_split = DcpPlanner(ctx, score)
    without = DcpPlanner(ctx, score, config=replace(DEFAULT, whole_per_gpu=0.0))
    t_with = simulate([with_split.plan(step)], ctx).total_time
    t_without = simulate([without.plan(step)], ctx).total_time
    assert with_split.kept_by == Counter({"packing": 1})
    assert all(len(g.micro_batches) <= 1 for g in with_split.plan(step).groups)  # the split's plan
    assert t_with < t_without * (1 - 1e-3)
    assert t_with >= LowerBound(ctx).step(step) * (1 - 1e-9)


def test_the_split_declines_steps_of_two_micro_batches_per_rank_and_mixed_sizes():
    ctx, step = first_step("video", "image-buckets", 8, 32)  # 9 images per GPU
    assert WholeSplit(SamplePacker(ctx, "pac")).plan(list(step.sample_ids)) is None
    ctx, step = first_step("text", "long-cpt", 8, 32)  # text classes hold many lengths
    assert WholeSplit(SamplePacker(ctx, "pac")).plan(list(step.sample_ids)) is None


def test_an_epochs_planner_prices_the_copies_ahead_and_plans_as_one_pricing_lazily():
    """`dcp` tuned on an epoch prices the split's copies in its setup (`DcpPlanner.prepare`),
    each shape up to its largest count in a step of few enough samples per GPU; planning the
    epoch then prices nothing more, and the plans are those of a planner pricing on the
    first step that reaches the split (the packing candidate, which tries the split first,
    is kept on some of these steps)."""
    ctx, steps = build_cell("video", "image-buckets", 128, SCENARIOS["video"].tokens_per_step // 8, 3)
    steps = steps[:3]
    score = step_seconds(ctx)
    ahead = make_planner("dcp", ctx, steps, score=score)
    lazy = DcpPlanner(ctx, score)
    (whole,) = [c.whole for c in ahead.scored if isinstance(c, SamplePacking)]
    (lazy_whole,) = [c.whole for c in lazy.scored if isinstance(c, SamplePacking)]
    priced = {key: top for key, (_, top) in whole._tau.items()}
    assert priced and not lazy_whole._tau
    for s in steps:
        assert ahead.plan(s).to_json() == lazy.plan(s).to_json()
    assert {key: top for key, (_, top) in whole._tau.items()} == priced  # nothing priced while planning
    assert ahead.kept_by["packing"] >= 1 and set(lazy_whole._tau) <= set(priced)
    for key, (tau, top) in lazy_whole._tau.items():  # the same times, over the counts both priced
        n = min(top, priced[key])
        assert (tau[:n] == whole._tau[key][0][:n]).all()


def test_the_split_reads_copies_up_to_its_largest_class_and_plans_as_with_all(images, monkeypatch):
    """The split reads each size's copies only up to the step's largest class (a class splits
    into micro-batches of at most its own count): its plan is the plan with every priced count
    read (`MAX_COPIES`), on the image step and on a video-mix step at 128 GPUs (81 clips, where
    a class goes whole into one micro-batch: reading one copy fewer changes the plan)."""
    steps = [images, first_step("video", "video-mix", 128, 8)]
    read = []
    copies = WholeSplit.copies
    monkeypatch.setattr(
        WholeSplit, "copies", lambda self, z, n, upto=MAX_COPIES: read.append(upto) or copies(self, z, n, upto)
    )
    trimmed = [WholeSplit(SamplePacker(ctx, "pac")).plan(list(step.sample_ids)) for ctx, step in steps]
    monkeypatch.setattr(WholeSplit, "copies", lambda self, z, n, upto=MAX_COPIES: copies(self, z, n))
    full = [WholeSplit(SamplePacker(ctx, "pac")).plan(list(step.sample_ids)) for ctx, step in steps]
    assert all(t is not None for t in trimmed) and trimmed == full
    assert max(read) < 32  # up to the largest class of the step, not every priced count
