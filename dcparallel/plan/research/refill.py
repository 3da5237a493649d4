"""Refill what-ifs for `dcp`'s per-sample packing (`refill`): the small samples of a packed
step taken out of their micro-batches and dealt again, to see how much of a step's distance
from its bound a different dealing closes (`benchmarks/refill_probe.py`).

On steps of a few samples per GPU over many shapes, a micro-batch of small samples costs
about the launch floor (0.157 s for the video model on an H200) whatever its count up to a
knee. Given the packing (`SamplePacker.plan`):

1. the *fill* samples (of classes whose samples all have one size and whose preferred
   micro-batch holds several) are taken out; the other micro-batches keep their groups and
   sub-groups as the packing placed them, or are packed again without the fill samples
   (`SamplePacker.pack`, at the smallest target that packs them and at `RETARGETS` times it);
2. the fill samples are dealt onto the leaves (groups without sub-groups) and the free ranks
   (groups of one rank), one of two ways:
   - `one_shape` (a plan the runtime runs: a video micro-batch stacks samples of one latent
     shape, `spec.batch_key`): class by class, largest first, each sample joins a micro-batch
     of its class on a leaf where it still ends within a target T (the one that ends first),
     else starts one on the leaf where it fits tightest (best fit, the ranks' remaining room);
     the smallest T at which every sample is placed is bisected;
   - `mixed` (a what-if the runtime refuses: `data.collate` raises on a video micro-batch of
     two shapes): each sample, largest first, is added to the longest micro-batch of the leaf
     that finishes first, at its compute there (its class's copies past the floor, per sample);
3. the micro-batches are priced exactly (`PlanContext.fits_grid`) and the groups' finishes
   recomputed (`Packing.span`, as the packing predicts its own).

`refill` returns the fastest of these dealings, or None where it is not faster than the
packing. `dcp` does not use it: on the scale report's steps the `one_shape` dealing packs no
tighter than the packing (docs in `benchmarks/scale_cpu_2026-12-07.md`).

Short names: d (a degree index), k (an SP degree), T (a makespan target), tab (per degree
index, the times of m = 1.. copies of a class's shape), leaf (a group without sub-groups, by
its place in `Leaves`), grow (per leaf path, its micro-batches after the deal).
"""

from __future__ import annotations

import bisect
import heapq
import math
import weakref
from typing import NamedTuple

import numpy as np

from dcparallel.plan.dcp.packing import Group, Packing
from dcparallel.plan.dcp.sample import SamplePacker

#: the most samples of a fill micro-batch (the copies priced per class)
MAX_FILL = 64
#: the other micro-batches are also packed again at these multiples of the first target that packs them
RETARGETS = (1.03, 1.06, 1.1)
#: bisection steps of a target
BISECT_STEPS = 12


class Fill(NamedTuple):
    """A step's fill samples by class, largest first: each class's sample ids and, per degree
    index, the times of m = 1..`MAX_FILL` copies of its shape (inf where m do not fit)."""

    ids: list[list[int]]
    tab: list[list[list[float]]]


class Leaves(NamedTuple):
    """Groups without the fill samples: per leaf its degree index, its finish and where it
    lies (the path of group positions from its top-level group); the groups; the free ranks."""

    deg: list[int]
    finish: list[float]
    path: list[tuple[int, ...]]
    groups: list[Group]
    free: int


def refill(packer: SamplePacker, ids: list[int], packing: Packing, mixed: bool = False) -> Packing | None:
    """The fastest refill of `packing` (the step's samples `ids`, packed by `packer`) the
    `one_shape` dealing (or, `mixed`, the what-if) finds; None where none is faster."""
    fill = fill_classes(packer, ids)
    if not fill.ids:
        return None
    taken = {i for c in fill.ids for i in c}
    ways = [strip(packer, packing.groups, taken)]
    rest = sorted(i for i in ids if i not in taken)
    if rest:
        ways += [strip(packer, groups, set()) for groups in repacked(packer, rest, packing.span)]
    best = packing
    for lv in ways:
        got = deal_mixed(packer, lv, fill) if mixed else one_shape(packer, lv, fill, packing.span)
        if got is not None:
            out = grown(packer, lv, *got)
            if out.span < best.span:
                best = out
    return None if best is packing else best


def fill_classes(packer: SamplePacker, ids: list[int]) -> Fill:
    """The step's fill classes, largest samples first, with their copies' times."""
    ctx = packer.ctx
    by_class: dict = {}
    for i in ids:
        by_class.setdefault(ctx.bucket_of[i], []).append(i)
    rows = []
    for b, members in by_class.items():
        if ctx.preferred(b, packer.mode).layout.mbs > 1 and len({ctx.sizes[i] for i in members}) == 1:
            rows.append((-ctx.tokens[members[0]], sorted(members)))
    rows.sort(key=lambda r: (r[0], r[1][0]))
    tabs = [
        [ctx.copies_times([ctx.sizes[r[1][0]]], [MAX_FILL], k, packer.mode)[0].tolist() for k in packer.sp]
        for r in rows
    ]
    return Fill([r[1] for r in rows], tabs)


def repacked(packer: SamplePacker, rest: list[int], ceiling: float) -> list[list[Group]]:
    """The other samples packed again in micro-batches of their preferred size, at the
    smallest target below `ceiling` that packs them (bisected, packing assumed monotone) and
    at `RETARGETS` times it."""
    p = packer
    items = p.items(rest)
    t = p.times(items)
    f = p.alone(t)
    if not np.isfinite(f.min(axis=1)).all():
        return []
    first = [it[0] for it in items]
    memo: dict = {}
    lo = max(float(f.min(axis=1).max()), float(np.min(t * p.kf, axis=1).sum()) / p.world)
    if lo >= ceiling or p.pack(first, t, f, ceiling, memo=memo) is None:
        return []
    hi = ceiling
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        if p.pack(first, t, f, mid, memo=memo) is None:
            lo = mid
        else:
            hi = mid
    out = []
    for T in [hi] + [hi * x for x in RETARGETS]:
        nodes = p.pack(first, t, f, T, memo=memo)
        if nodes is not None:
            out.append([_node_group(p, nodes, i, items, t) for i, n in enumerate(nodes) if n.base is None])
    return out


def _node_group(packer: SamplePacker, nodes, i: int, items: list[tuple[int, ...]], t: np.ndarray) -> Group:
    """Packed node i (`SamplePacker.pack`'s) as a group with its sub-groups."""
    n = nodes[i]
    kids = [_node_group(packer, nodes, c, items, t) for c in n.kids]
    return Group(packer.sp[n.deg], 0.0, [items[a] for a in n.rows], kids)


#: per packer, each micro-batch's times at its degrees (`price`), kept while the packer lives
_PRICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def price(packer: SamplePacker, items) -> None:
    """The micro-batches' times at every degree (`SamplePacker.times`), for `_time`."""
    rows = _PRICES.setdefault(packer, {})
    new = [it for it in dict.fromkeys(items) if it not in rows]
    if new:
        rows.update(zip(new, packer.times(new)))


def _time(packer: SamplePacker, item: tuple[int, ...], k: int) -> float:
    """A micro-batch's time at degree k, as `price` priced it."""
    return float(_PRICES[packer][item][packer.sp.index(k)])


def _items(groups: list[Group]):
    for g in groups:
        yield from g.items
        yield from _items(g.subgroups)


def strip(packer: SamplePacker, groups: list[Group], fill: set[int]) -> Leaves:
    """The groups without their micro-batches of fill samples, and their leaves."""
    price(packer, _items(groups))
    lv = Leaves([], [], [], [], packer.world - sum(g.sp for g in groups))
    for x, g in enumerate(groups):
        kept = [it for it in g.items if it[0] not in fill]
        last = max((_time(packer, it, g.sp) for it in kept), default=0.0)
        lv.groups.append(_strip(packer, g, fill, (x,), packer.exposed(last), lv))
    return lv


def _strip(packer: SamplePacker, g: Group, fill: set[int], path: tuple[int, ...], at: float, lv: Leaves) -> Group:
    kept = [it for it in g.items if it[0] not in fill]
    at += sum(_time(packer, it, g.sp) for it in kept)
    kids = [_strip(packer, c, fill, path + (x,), at, lv) for x, c in enumerate(g.subgroups)]
    if not kids:
        lv.deg.append(packer.sp.index(g.sp))
        lv.finish.append(at)
        lv.path.append(path)
    return Group(g.sp, 0.0, kept, kids)


def _leaf(groups: list[Group], path: tuple[int, ...]) -> Group:
    g = groups[path[0]]
    for x in path[1:]:
        g = g.subgroups[x]
    return g


def one_shape(packer: SamplePacker, lv: Leaves, fill: Fill, ceiling: float):
    """The `one_shape` dealing at the smallest target up to `ceiling` that places every fill
    sample (bisected from the leaves' latest finish): (grow, opened), or None if none does."""
    lo, hi, got = max(lv.finish, default=0.0), ceiling, None
    if lo >= hi:
        return None
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        dealt = deal_one_shape(packer, lv, fill, mid)
        if dealt is None:
            lo = mid
        else:
            hi, got = mid, dealt
    return got


def deal_one_shape(packer: SamplePacker, lv: Leaves, fill: Fill, T: float):
    """The fill samples dealt at target T, class by class: each joins the micro-batch of its
    class (one per leaf at most) that ends first within T, else starts one on the leaf
    where it fits tightest. (grow, opened), or None if a sample fits nowhere within T."""
    fin = list(lv.finish) + [packer.exposed(0.0)] * lv.free  # free ranks: leaves of degree index 0
    deg = list(lv.deg) + [0] * lv.free
    by_deg: list[list[tuple[float, int]]] = [[] for _ in packer.sp]  # per degree index: (finish, leaf), sorted
    for j, (f, d) in enumerate(zip(fin, deg)):
        by_deg[d].append((f, j))
    for lst in by_deg:
        lst.sort()
    mbs: list[list[tuple[int, ...]]] = [[] for _ in fin]
    for ids, tab in zip(fill.ids, fill.tab):
        held: dict[int, list[int]] = {}  # per leaf: its micro-batch of this class
        for i in ids:
            end, to = math.inf, -1
            for j, got in held.items():
                m, d = len(got), deg[j]
                if m < MAX_FILL and fin[j] + tab[d][m] - tab[d][m - 1] <= min(T, end):
                    end, to = fin[j] + tab[d][m] - tab[d][m - 1], j
            if to < 0:
                end, to = _tightest(by_deg, tab, held, T)
                if to < 0:
                    return None
            lst = by_deg[deg[to]]
            lst.pop(bisect.bisect_left(lst, (fin[to], to)))
            fin[to] = end
            bisect.insort(lst, (end, to))
            held.setdefault(to, []).append(i)
        for j, got in held.items():
            mbs[j].append(tuple(got))
    n = len(lv.finish)
    grow = {path: _leaf(lv.groups, path).items + m for path, m in zip(lv.path, mbs) if m}
    return grow, [m for m in mbs[n:] if m]


def _tightest(by_deg: list[list[tuple[float, int]]], tab, held: dict, T: float) -> tuple[float, int]:
    """Over the degrees, the leaf without a micro-batch of the class whose finish with one
    sample more is the latest within T: (that finish, the leaf), or (inf, -1)."""
    end, to = -math.inf, -1
    for d, lst in enumerate(by_deg):
        x = bisect.bisect_right(lst, (T - tab[d][0], math.inf)) - 1
        while x >= 0 and lst[x][1] in held:
            x -= 1
        if x >= 0 and lst[x][0] + tab[d][0] > end:
            end, to = lst[x][0] + tab[d][0], lst[x][1]
    return (end, to) if to >= 0 else (math.inf, -1)


def compute_price(tab: list[float]) -> float:
    """A sample's compute added to a micro-batch of compute-bound size: its class's copies
    past the floor (the first count that takes twice one sample's time, else the most that
    fit), per sample over the upper half of the counts."""
    tt = np.asarray(tab)
    fit = np.flatnonzero(np.isfinite(tt))
    past = np.flatnonzero(tt >= 2 * tt[0])
    hi = int(past[0]) if len(past) else (int(fit[-1]) if len(fit) else 0)
    lo = hi // 2
    return float(tt[hi] - tt[lo]) / (hi - lo) if hi > lo else float(tt[0])


def deal_mixed(packer: SamplePacker, lv: Leaves, fill: Fill):
    """The `mixed` what-if: each fill sample (largest compute first) added to the longest
    micro-batch of the leaf that finishes first (a leaf or free rank without one starts one).
    (grow, opened)."""
    rows = []
    for ids, tab in zip(fill.ids, fill.tab):
        mu = [compute_price(t) for t in tab]
        one = [t[0] for t in tab]
        rows.extend((-mu[0], i, mu, one) for i in ids)
    rows.sort(key=lambda r: (r[0], r[1]))
    fin = list(lv.finish) + [packer.exposed(0.0)] * lv.free
    deg = list(lv.deg) + [0] * lv.free
    added: list[list[int]] = [[] for _ in fin]
    empty = [not _leaf(lv.groups, p).items for p in lv.path] + [True] * lv.free
    heap = [(f, j) for j, f in enumerate(fin)]
    heapq.heapify(heap)
    for _, i, mu, one in rows:
        f, j = heapq.heappop(heap)
        f += one[deg[j]] if empty[j] and not added[j] else mu[deg[j]]
        added[j].append(i)
        heapq.heappush(heap, (f, j))
    grow = {}
    for path, ids in zip(lv.path, added):
        if ids:
            items = sorted(_leaf(lv.groups, path).items, key=lambda it: (len(it), it))
            longest = max(items, key=lambda it: _time(packer, it, _leaf(lv.groups, path).sp), default=())
            grow[path] = [it for it in items if it is not longest] + [longest + tuple(ids)]
    return grow, [[tuple(ids)] for ids in added[len(lv.finish) :] if ids]


def grown(packer: SamplePacker, lv: Leaves, grow: dict, opened: list[list[tuple[int, ...]]]) -> Packing:
    """The groups after a deal (`grow`: per leaf path its micro-batches; `opened`: groups of
    one rank on free ranks), every micro-batch priced exactly (inf where one does not fit)."""
    price(packer, [mb for mbs in list(grow.values()) + opened for mb in mbs])
    top = [_build(packer, g, (x,), grow, None) for x, g in enumerate(lv.groups)]
    top += [_build(packer, Group(packer.sp[0], 0.0, mbs, []), (), {}, None) for mbs in opened]
    top = [g for g in top if g.items or g.subgroups]
    top.sort(key=lambda g: (-g.sp, -g.finish, g.items[0] if g.items else ()))
    return Packing(top, max(g.finish for g in top))


def _build(packer: SamplePacker, g: Group, path: tuple[int, ...], grow: dict, base: float | None) -> Group:
    """Group g (at `path`) with its micro-batches as grown, shortest first (the gradient sync
    overlaps the longest backward); its finish the latest of its tree's."""
    items = sorted(grow.get(path, g.items), key=lambda it: (_time(packer, it, g.sp), it))
    load = sum(_time(packer, it, g.sp) for it in items)
    if base is None:
        fin = load + packer.exposed(_time(packer, items[-1], g.sp) if items else 0.0)
    else:
        fin = base + load
    kids = [_build(packer, c, path + (x,), grow, fin) for x, c in enumerate(g.subgroups)]
    return Group(g.sp, max([fin] + [k.finish for k in kids]), items, kids)
