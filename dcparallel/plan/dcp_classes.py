"""`dcp`'s group classes: alike groups of one SP degree, and LPT dealing of whole classes.

Micro-batch classes are dealt to them by the longest-processing-time rule applied to whole
classes."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from dcparallel.plan.types import ROUND_EPS


@dataclass(slots=True)
class GroupClass:
    """`count` alike groups of one SP degree with the same load and the same contents:
    `items` maps an item-class index to how many of its micro-batches each group runs."""

    load: float
    count: int
    items: dict[int, int]


class ItemClass(NamedTuple):
    """`count` micro-batches of one bucket with `mbs` samples each, at SP degree `sp`."""

    bucket: int
    sp: int
    mbs: int
    time: float
    count: int


def deal_classes(items: Sequence[tuple[int, float, int]], n: int) -> list[GroupClass]:
    """LPT over classes: `items` are (item-class index, time, count), dealt longest first to
    `n` alike groups; each group class takes items while its load is below the next lowest
    class's load. Returns the group classes (counts sum to n).

    The classes are kept in ascending load, a class that took items placed before the others
    of its new load and a class split off after them (as a stable sort of the list with the
    changed class first and the new one last would place them)."""
    classes = [GroupClass(0.0, n, {})]
    loads = [0.0]
    ceil = math.ceil
    for ic, t, q in sorted(items, key=_longest_first):
        while q > 0:
            c = classes.pop(0)
            low = loads.pop(0)
            per = ceil((loads[0] - low) / t - ROUND_EPS) if loads else 1
            if per < 1:
                per = 1
            more = None
            if per * c.count <= q:
                c.load += per * t
                c.items[ic] = c.items.get(ic, 0) + per
                q -= per * c.count
            else:
                a, r = divmod(q, c.count)
                if r:
                    more = GroupClass(c.load + (a + 1) * t, r, dict(c.items))
                    more.items[ic] = more.items.get(ic, 0) + a + 1
                    c.count -= r
                if a:
                    c.load += a * t
                    c.items[ic] = c.items.get(ic, 0) + a
                q = 0
            i = bisect_left(loads, c.load)
            classes.insert(i, c)
            loads.insert(i, c.load)
            if more is not None:
                i = bisect_right(loads, more.load)
                classes.insert(i, more)
                loads.insert(i, more.load)
        if len(classes) > 8:
            classes, loads = _merge(classes, loads)
    return [c for c in _merge(classes, loads)[0] if c.count > 0]


def _longest_first(item: tuple[int, float, int]) -> tuple[float, int]:
    return -item[1], item[0]


def _merge(classes: list[GroupClass], loads: list[float]) -> tuple[list[GroupClass], list[float]]:
    """Alike group classes (same load, same contents) as one, in order (ascending load, first
    seen first). Only classes of equal load can be alike, so the contents are compared only
    then. A class's contents list its item classes in the order they were dealt, which is the
    same for every class, so equal contents have equal item sequences."""
    if len(set(loads)) == len(loads):  # ascending, so all distinct = strictly increasing
        return classes, loads
    out: dict[tuple, GroupClass] = {}
    for c in classes:
        key = (c.load, tuple(c.items.items()))
        hit = out.get(key)
        if hit is None:
            out[key] = c
        else:
            hit.count += c.count
    merged = list(out.values())
    return merged, [c.load for c in merged]


def class_span(items: Sequence[tuple[int, float, int]], n: int) -> float:
    """The makespan `deal_classes` reaches, tracking loads only (no contents): the distinct
    loads in ascending order, with how many groups carry each. (The planner's innermost
    loop: written out, without helper calls.)"""
    loads, counts = [0.0], [n]
    ceil = math.ceil
    for _, t, q in sorted(items, key=_longest_first):
        while q > 0:
            low, cnt = loads.pop(0), counts.pop(0)
            per = ceil((loads[0] - low) / t - ROUND_EPS) if loads else 1
            if per < 1:
                per = 1
            if per * cnt <= q:
                load = low + per * t
                i = bisect_left(loads, load)
                if i < len(loads) and loads[i] == load:
                    counts[i] += cnt
                else:
                    loads.insert(i, load)
                    counts.insert(i, cnt)
                q -= per * cnt
                continue
            a, r = divmod(q, cnt)
            for load, c in ((low + (a + 1) * t, r), (low + a * t, cnt - r)):
                if c:
                    i = bisect_left(loads, load)
                    if i < len(loads) and loads[i] == load:
                        counts[i] += c
                    else:
                        loads.insert(i, load)
                        counts.insert(i, c)
            q = 0
    return loads[-1]


def cut_starts(items: Sequence[ItemClass], cursor: dict[int, int]) -> list[int]:
    """Where each item class's micro-batches start among its bucket's samples (sorted longest
    first): item classes cut their bucket's samples in order, `count * mbs` each, from
    `cursor` (per bucket, the samples already cut: earlier phases), which is advanced."""
    out = []
    for it in items:
        at = cursor.get(it.bucket, 0)
        out.append(at)
        cursor[it.bucket] = at + it.count * it.mbs
    return out
