"""The refill what-ifs (`plan/research/refill.py`) on real steps of the scale report's mixes,
reduced to 8 GPUs: the one-shape dealing places every sample once, in micro-batches of one
latent shape that fit memory, as a valid plan the simulator times as predicted; `refill`
returns only a plan faster than the packing; the mixed what-if mixes shapes."""

from __future__ import annotations

import math

import pytest

from benchmarks.tight_bound import build_cell
from dcparallel.plan.dcp.sample import SamplePacker
from dcparallel.plan.research.refill import deal_mixed, deal_one_shape, fill_classes, grown, refill, strip
from dcparallel.scenarios import SCENARIOS
from dcparallel.sim.replay import simulate

WORLD = 8


@pytest.fixture(scope="module", params=["video-mix", "image-buckets"])
def packed(request):
    """A mix's first step at 8 GPUs (the 32-GPU budget over 32: a few samples per GPU over
    tens of shapes), its packer and packing."""
    ctx, steps = build_cell("video", request.param, WORLD, SCENARIOS["video"].tokens_per_step // 32, 2)
    step = steps[0]
    packer = SamplePacker(ctx, "pac")
    ids = list(step.sample_ids)
    return ctx, step, packer, ids, packer.plan(ids)


def check(ctx, step, packer, packing):
    """The packing's plan is valid, uses every sample once, fits memory and is simulated at
    its predicted time; returns its micro-batches."""
    plan = packer.step_plan(step, packing.groups)
    plan.validate(WORLD)
    mbs = list(plan.micro_batches())
    assert sorted(i for mb in mbs for i in mb.sample_ids) == sorted(step.sample_ids)
    sim = simulate([plan], ctx)
    assert sim.memory_violations == 0
    assert sim.total_time == pytest.approx(packing.span, rel=1e-9)
    return mbs


def test_one_shape_dealing_is_a_valid_plan_of_one_shape_micro_batches(packed):
    ctx, step, packer, ids, packing = packed
    fill = fill_classes(packer, ids)
    assert fill.ids, "the step has small samples of shapes that share micro-batches"
    lv = strip(packer, packing.groups, {i for c in fill.ids for i in c})
    assert deal_one_shape(packer, lv, fill, max(lv.finish) * 0.5) is None  # no room below the rest's finish
    dealt = deal_one_shape(packer, lv, fill, 2 * packing.span)
    assert dealt is not None
    got = grown(packer, lv, *dealt)
    assert math.isfinite(got.span)
    for mb in check(ctx, step, packer, got):
        assert len({ctx.bucket_of[i] for i in mb.sample_ids}) == 1


def test_refill_returns_only_faster_plans_and_the_mixed_what_if_mixes_shapes(packed):
    ctx, step, packer, ids, packing = packed
    for mixed in (False, True):
        got = refill(packer, ids, packing, mixed=mixed)
        if got is not None:
            assert got.span < packing.span
            check(ctx, step, packer, got)
    fill = fill_classes(packer, ids)
    lv = strip(packer, packing.groups, {i for c in fill.ids for i in c})
    got = grown(packer, lv, *deal_mixed(packer, lv, fill))
    mbs = check(ctx, step, packer, got)
    assert any(len({ctx.bucket_of[i] for i in mb.sample_ids}) > 1 for mb in mbs)
