"""`dcp`'s group classes: alike groups of one SP degree, and LPT dealing of whole classes.

Micro-batch classes are dealt to them by the longest-processing-time rule applied to whole
classes. Also what a class-level plan is (`ClassPlan`) and what tells two apart.

Short names: ic (an item class's index), t (a micro-batch time), q (micro-batches left to
deal), n (groups), c (a `GroupClass`), w (an item class's signature weight), per
(micro-batches of the item class each group of a class takes), a / r (the quotient and
remainder of a deal over a class's groups), low (the least load).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from dcparallel.plan.types import ROUND_EPS, StepPlan


@dataclass(slots=True)
class GroupClass:
    """`count` alike groups of one SP degree with the same load and the same contents:
    `items` maps an item-class index to how many of its micro-batches each group runs;
    `sig` is a hash of `items` kept up to date by `add` (equal contents, equal `sig`), so
    that alike classes are found without comparing every class's contents."""

    load: float
    count: int
    items: dict[int, int]
    sig: int = 0

    def add(self, ic: int, n: int) -> None:
        """`n` more micro-batches of item class `ic` on each group."""
        self.items[ic] = self.items.get(ic, 0) + n
        self.sig += n * sig_weight(ic)


def sig_weight(ic: int) -> int:
    """What one micro-batch of item class `ic` adds to a class's `sig` (the same in every
    process): `sig` is the sum over its items of count x weight."""
    return (ic + 1) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFF


class ItemClass(NamedTuple):
    """`count` micro-batches of one class with `mbs` samples each, at SP degree `sp`."""

    pclass: int
    sp: int
    mbs: int
    time: float
    count: int


class MbClass(NamedTuple):
    """`count` micro-batches of one item class (an index into the phase's item classes), each
    taking `time`: what a degree's groups are dealt (`deal_classes`, `class_span`)."""

    item: int
    time: float
    count: int


class DegreeGroups(NamedTuple):
    """A phase's groups per SP degree: each degree's micro-batch classes and its number of groups."""

    classes: dict[int, list[MbClass]]
    count: dict[int, int]


class Allocation(NamedTuple):
    """One layout choice allocated (`allocate.allocate`): its predicted makespan, its item
    classes and its groups per degree."""

    span: float
    items: list[ItemClass]
    groups: DegreeGroups


def deal_classes(items: Sequence[MbClass], n: int) -> list[GroupClass]:
    """LPT over classes (whole classes of micro-batches to classes of alike groups, so not
    `plan.assemble.lpt`, which deals single items): `items` (`MbClass`: item-class index, time,
    count) are dealt longest first to
    `n` alike groups; each group class takes items while its load is below the next lowest
    class's load. Returns the group classes (counts sum to n).

    The classes are kept in ascending load, a class that took items placed before the others
    of its new load and a class split off after them (as a stable sort of the list with the
    changed class first and the new one last would place them)."""
    classes = [GroupClass(0.0, n, {})]
    loads = [0.0]
    touched: set[float] = set()  # loads a class was inserted at since the last merge
    ceil = math.ceil
    for ic, t, q in sorted(items, key=_longest_first):
        w = sig_weight(ic)  # `GroupClass.add`, written out: this is the planner's inner loop
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
                c.sig += per * w
                q -= per * c.count
            else:
                a, r = divmod(q, c.count)
                if r:
                    more = GroupClass(c.load + (a + 1) * t, r, dict(c.items), c.sig + (a + 1) * w)
                    more.items[ic] = more.items.get(ic, 0) + a + 1
                    c.count -= r
                if a:
                    c.load += a * t
                    c.items[ic] = c.items.get(ic, 0) + a
                    c.sig += a * w
                q = 0
            i = bisect_left(loads, c.load)
            classes.insert(i, c)
            loads.insert(i, c.load)
            touched.add(c.load)
            if more is not None:
                i = bisect_right(loads, more.load)
                classes.insert(i, more)
                loads.insert(i, more.load)
                touched.add(more.load)
        if len(classes) > 8:
            _merge_runs(classes, loads, touched)
            touched = set()
    return [c for c in _merge(classes, loads)[0] if c.count > 0]


def _longest_first(item: MbClass) -> tuple[float, int]:
    ic, t, _ = item
    return -t, ic


def _merge_runs(classes: list[GroupClass], loads: list[float], touched: set[float]) -> None:
    """`_merge` in place, of the runs of equal load in `touched` only: a run no class was
    inserted into since the last merge holds no alike classes (a class changes load or
    contents only between being popped and inserted again). So a merge costs what changed,
    not the number of classes."""
    if len(touched) > len(loads) // 8 and len(set(loads)) == len(loads):  # no equal loads at all
        return  # (one pass in C: cheaper than the runs when much changed)
    for load in sorted(touched, reverse=True):  # from the back: earlier runs keep their positions
        a, b = bisect_left(loads, load), bisect_right(loads, load)
        if b - a > 1:
            run, _ = _merge(classes[a:b], loads[a:b])
            classes[a:b] = run
            loads[a:b] = [load] * len(run)


def _merge(classes: list[GroupClass], loads: list[float]) -> tuple[list[GroupClass], list[float]]:
    """Alike group classes (same load, same contents) as one, in order (ascending load, first
    seen first). Only classes of equal load and equal `sig` can be alike, so the contents
    are compared only then (a hash collision keeps unlike classes apart). The cost is linear
    in the number of classes, whatever the number of item classes they hold."""
    if len(set(loads)) == len(loads):  # ascending, so all distinct = strictly increasing
        return classes, loads
    seen: dict[tuple[float, int], list[GroupClass]] = {}
    merged: list[GroupClass] = []
    for c in classes:
        same = seen.setdefault((c.load, c.sig), [])
        for hit in same:
            if hit.items == c.items:
                hit.count += c.count
                break
        else:
            same.append(c)
            merged.append(c)
    return merged, [c.load for c in merged]


def class_span(items: Sequence[MbClass], n: int) -> float:
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
    """Where each item class's micro-batches start among its class's samples (sorted longest
    first): item classes cut their class's samples in order, `count * mbs` each, from
    `cursor` (per class, the samples already cut: earlier phases), which is advanced."""
    out = []
    for it in items:
        at = cursor.get(it.pclass, 0)
        out.append(at)
        cursor[it.pclass] = at + it.count * it.mbs
    return out


def plan_sig(items: list[ItemClass], groups: DegreeGroups) -> tuple:
    """What tells two class-level plans apart: their item classes and groups per degree."""
    return tuple((it.pclass, it.sp, it.mbs) for it in items), tuple(sorted(groups.count.items()))


class PartPlan(NamedTuple):
    """A class-level plan of one phase's classes: its predicted makespan, its item classes,
    its micro-batch classes and groups per degree (`allocate.allocate`), and the class-level
    bound of those classes (`search.part_bound`)."""

    span: float
    items: list[ItemClass]
    groups: DegreeGroups
    bound: float


def distinct_plans(plans: list[PartPlan], keep: int) -> list[PartPlan]:
    """The first `keep` of these plans, sorted, that are distinct."""
    out, seen = [], set()
    for plan in plans:
        sig = plan_sig(plan.items, plan.groups)
        if sig not in seen:
            seen.add(sig)
            out.append(plan)
            if len(out) == keep:
                break
    return out


class StepChoice(NamedTuple):
    """A step's class-level candidate: a `PartPlan` per phase and their summed predicted time."""

    span: float
    parts: list[PartPlan]


class ClassPlan(NamedTuple):
    """A step's class-level plan, its predicted compute time, the step's compute bound at class
    level (`search.part_bound`) and the longest of its classes' least micro-batch times."""

    plan: StepPlan
    predicted: float
    bound: float
    longest: float
