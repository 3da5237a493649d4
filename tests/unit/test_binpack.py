"""`plan.binpack`: the O(n log n) first-fit-decreasing packing makes exactly the bins of the
quadratic first fit it replaces (kept below as the oracle: scan every bin for each sample,
then check each bin with `layout_for`), on random text and video steps, capacities from
below one sample to the whole step, every recompute mode; and `RoomTree` against a scan."""

import random

import pytest

from dcparallel.plan.binpack import RoomTree, first_fit_decreasing, pack_bins
from dcparallel.plan.context import PlanContext
from dcparallel.spec import Workload

from ._models import TINY_DIT, TINY_LM, VIDEO_SHAPES, cluster, cost


def oracle_pack_bins(ctx, ids, capacity, sp, mode):
    """First fit decreasing by scanning the bins, each bin split where it stops fitting."""
    if ctx.model.kind == "text":
        classes = [list(ids)]
    else:
        by_key = {}
        for i in ids:
            by_key.setdefault(ctx.bucket_of[i], []).append(i)
        classes = [by_key[k] for k in sorted(by_key)]
    out = []
    for members in classes:
        bins, room = [], []
        for i in sorted(members, key=lambda j: (-ctx.tokens[j], j)):
            t = ctx.tokens[i]
            b = next((b for b in range(len(bins)) if room[b] >= t), None)
            if b is None:
                bins.append([i])
                room.append(capacity - t)
            else:
                bins[b].append(i)
                room[b] -= t
        for b in bins:
            if ctx.layout_for(tuple(ctx.sizes[j] for j in b), sp, mode) is not None:
                out.append(b)
                continue
            cur = []
            for i in b:
                if cur and ctx.layout_for(tuple(ctx.sizes[j] for j in cur + [i]), sp, mode) is None:
                    out.append(cur)
                    cur = []
                cur.append(i)
            out.append(cur)
    return out


def _context(model, sizes, memory_mib):
    cl = cluster(8, 8, memory_mib)
    return PlanContext(Workload(model, tuple(sizes)), cost(model, cl), cl)


@pytest.mark.parametrize("kind", ["text", "video"])
def test_pack_bins_equals_the_quadratic_first_fit(kind):
    rng = random.Random(7 if kind == "text" else 8)
    splits = 0
    for trial in range(30):
        n = rng.randint(1, 400)
        if kind == "text":  # short documents, many of one length, a few long ones
            sizes = [rng.choice([rng.randint(16, 300), 128, 512, rng.randint(300, 6000)]) for _ in range(n)]
            ctx = _context(TINY_LM, sizes, 1536)
        else:
            sizes = [rng.choice(VIDEO_SHAPES) for _ in range(n)]
            ctx = _context(TINY_DIT, sizes, 256)  # a few clips of the largest shape fill it
        ids = rng.sample(range(n), rng.randint(0, n))
        top = max(ctx.tokens)
        capacity = rng.choice([max(1, top // 3), top, 2 * top, 8 * top, sum(ctx.tokens)])
        sp, mode = rng.choice(ctx.sp_sizes[:2]), rng.choice(["none", "full", "pac"])
        want = oracle_pack_bins(ctx, ids, capacity, sp, mode)
        got = pack_bins(ctx, ids, capacity, sp, mode)
        assert got == want, (trial, capacity, sp, mode)
        splits += len(got) > len(first_fit_bins(ctx, ids, capacity))
    assert splits > 0  # some bins were cut for memory: the split path is compared too


def first_fit_bins(ctx, ids, capacity):
    if ctx.model.kind == "text":
        return first_fit_decreasing(ids, ctx.tokens, capacity)
    keys = sorted({ctx.bucket_of[i] for i in ids})
    return [
        b for k in keys for b in first_fit_decreasing([i for i in ids if ctx.bucket_of[i] == k], ctx.tokens, capacity)
    ]


def test_first_fit_with_runs_of_one_length_and_items_over_the_capacity():
    tokens = [5, 5, 5, 5, 5, 3, 3, 12, 1, 1, 1, 1]
    # 12 exceeds 10: a bin of its own (room -2); 5s pair up; 3s fill a bin and the 1s the gaps
    assert first_fit_decreasing(range(12), tokens, 10) == [[7], [0, 1], [2, 3], [4, 5, 8, 9], [6, 10, 11]]
    assert first_fit_decreasing([], tokens, 10) == []


def test_room_tree_finds_the_leftmost_bin_with_room():
    rng = random.Random(3)
    tree, rooms = RoomTree(), []
    for _ in range(2000):
        if len(rooms) < 100 and rng.random() < 0.3:  # past 16 and 32 bins: the tree grows
            rooms.append(rng.randint(-5, 100))
            assert tree.open(rooms[-1]) == len(rooms) - 1
        elif rooms:
            b = rng.randrange(len(rooms))
            rooms[b] = rng.randint(-5, 100)
            tree.set(b, rooms[b])
        t = rng.randint(-5, 110)
        assert tree.leftmost(t) == next((b for b, r in enumerate(rooms) if r >= t), None)
