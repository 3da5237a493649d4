"""`dcp`'s planning classes (`tables.planning_classes`) and per-sample weights, built in array
passes, against their definitions written sample by sample, on realistic mixes: finer text
length ranges of a long-context continued-pretraining mix and of a chat / long-document SFT
mix, and the classes of a 60-shape video mix."""

import math

import numpy as np
import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.vision import class_rep
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.config import DEFAULT
from dcparallel.plan.dcp.tables import LayoutTable, planning_classes
from dcparallel.scenarios import SCENARIOS, sample_sizes
from dcparallel.spec import Workload
from tests.unit._models import TINY_LM, cluster, cost


def context(scenario: str, mix: str, n: int) -> PlanContext:
    sc = SCENARIOS[scenario]
    wl = Workload(sc.model, tuple(sample_sizes(scenario, mix, num_samples=n)))
    cl = sc.cluster(1024)
    return PlanContext(wl, AnalyticCost(sc.model, cl), cl)


def classes_by_definition(ctx: PlanContext, sub_bins: int) -> tuple[dict, list, list[int]]:
    """Each usable sample's class, (class, int(log2(tokens) * sub_bins)) or its class; a
    class's size `class_rep` of its members in id order; classes sorted; -1 for the others."""
    if sub_bins == 1:
        key = {i: ctx.bucket_of[i] for i in ctx.usable_ids}
    else:
        key = {i: (ctx.bucket_of[i], int(math.log2(max(1, ctx.tokens[i])) * sub_bins)) for i in ctx.usable_ids}
    members: dict = {}
    for i, c in key.items():
        members.setdefault(c, []).append(i)
    rep = {c: class_rep([ctx.sizes[i] for i in ids], [ctx.tokens[i] for i in ids]) for c, ids in members.items()}
    classes = sorted(rep)
    idx = [-1] * len(ctx.sizes)
    for i, c in key.items():
        idx[i] = classes.index(c)
    return rep, classes, idx


@pytest.mark.parametrize(
    ("scenario", "mix", "sub_bins"),
    [
        ("text", "long-cpt", DEFAULT.finer_sub_bins),
        ("text", "sft-chat-long", DEFAULT.finer_sub_bins),
        ("video", "video-mix", 1),
    ],
)
def test_planning_classes_and_weights_are_their_definitions(scenario, mix, sub_bins):
    ctx = context(scenario, mix, 2000)
    rep, classes, idx = classes_by_definition(ctx, sub_bins)
    got = planning_classes(ctx, sub_bins)
    assert len(classes) > 20  # many classes, most of several samples
    assert got[0] == rep and got[1] == classes and got[2].tolist() == idx
    # weights: linear in tokens from each class's smallest sample (weight below 1) to its
    # largest (1), so as many distinct weights as lengths; one measured from a sample not the
    # smallest would give the samples below it one weight
    w = LayoutTable(ctx, sub_bins=sub_bins).weight
    ids = np.asarray(ctx.usable_ids)
    tok = np.asarray(ctx.tokens)[ids]
    several = 0
    for j in range(len(classes)):
        at = np.asarray(idx)[ids] == j
        lengths, weights = np.unique(tok[at]), np.unique(w[ids][at])
        assert weights.max() == 1.0 and len(weights) in (1, len(lengths))
        several += len(lengths) > 1 and len(weights) == len(lengths)
    assert several > 10 or scenario == "video"  # a video class is one shape


def test_planning_classes_leave_out_skipped_samples_and_buckets_of_none_usable():
    """A bucket whose only sample is skipped (5M tokens at 64 MiB) is among the context's
    buckets (`PlanContext.bucket_positions`, every sample's) but not a planning class; the
    skipped sample's class index is -1 and the others' count the usable buckets only."""
    cl = cluster(2, 2, memory_mib=64)
    ctx = PlanContext(Workload(TINY_LM, (100, 5_000_000, 200, 300, 1_000)), cost(TINY_LM, cl), cl, skip_oversize=True)
    assert [s[0] for s in ctx.skipped] == [1]
    keys, at = ctx.bucket_positions()
    assert keys == sorted(set(ctx.bucket_of)) and at.tolist() == [keys.index(b) for b in ctx.bucket_of]
    assert ctx.bucket_positions()[1] is at and not at.flags.writeable  # made once, shared, read-only
    rep, classes, idx = classes_by_definition(ctx, 1)
    got = planning_classes(ctx, 1)
    assert ctx.bucket_of[1] not in classes and len(classes) == len(keys) - 1
    assert got[0] == rep and got[1] == classes and got[2].tolist() == idx and idx[1] == -1
