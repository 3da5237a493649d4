"""`dcp`'s expansion of a chosen class-level plan to sample ids and plan objects.

Micro-batches are dealt to groups, refined with each micro-batch's own time and moved across
SP degrees (the local searches of `refine`), and placed on ranks.

Each class's samples, longest first, are cut into its micro-batches and dealt round by round
to the groups holding that class (so every group gets a mix of its class's longer and
shorter samples); groups are placed as aligned blocks, largest first (a group no larger than
a node stays inside one; a larger one spans nodes and the cost model charges the link), and
each group runs its micro-batches shortest first, so its longest backward hides the most of
the gradient sync. The micro-batches of a phase are numpy arrays (`Phase`): a few array
operations per item class and refinement round (a spill move, touching two groups, is plain
Python). Plan objects (`MicroBatch`, `GroupPlan`) are built only for the expansion kept.

Short names: p (the `tables.LayoutTable`), ss (the step's samples, `StepSamples`), ph (a
`refine.Phase`), ic (an item class's index), g / g0 (a group / a range's first group), gc (a
`classes.GroupClass`), per (micro-batches of an item class per group), k (an SP degree),
m (a micro-batch size), n (groups, or samples), lo / hi (a range's ends), rc / rg / rper (per
row of the deal: its item class, its group, its micro-batches per group), pr (a (row, round)
pair).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from dcparallel.plan.assemble import assemble, with_idle
from dcparallel.plan.dcp.classes import GroupClass, PartPlan, cut_starts
from dcparallel.plan.dcp.refine import Phase, refine, spill
from dcparallel.plan.dcp.tables import LayoutTable
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, StepPlan, micro_batches
from dcparallel.spec import Layout


def deal_orders(holders: np.ndarray) -> np.ndarray:
    """The group of each micro-batch of every item class, in sample order, the classes
    concatenated in their order in `holders`: rows (item class, first group, count,
    micro-batches per group), one per range of alike groups holding some of the class, a
    class's rows consecutive. Round by round over the groups still holding some of the class,
    alternating direction and rotated per class, so each group gets longer and shorter samples
    of the class. In a few array operations: each (group, round) pair is one micro-batch,
    placed by its position among its class's groups in that round."""
    ic, g0, n, per = holders.T
    new = np.ones(len(ic), dtype=bool)
    new[1:] = ic[1:] != ic[:-1]
    hc = np.cumsum(new) - 1  # each row's class, numbered in order
    ics = ic[new]
    # one row per group holding a class: the class, the group, its micro-batches of the class
    rows = int(n.sum())
    rc, rper = np.repeat(hc, n), np.repeat(per, n)
    rg = np.repeat(g0, n) + np.arange(rows) - np.repeat(np.cumsum(n) - n, n)
    # one pair per (row, round) the row takes part in, ordered by (class, round, row)
    pr = np.repeat(np.arange(rows), rper)
    rnd = np.arange(len(pr)) - np.repeat(np.cumsum(rper) - rper, rper)
    key = rc[pr] * (int(per.max()) + 1) + rnd
    o = np.argsort(key, kind="stable")
    key, pr, rnd = key[o], pr[o], rnd[o]
    brk = np.ones(len(key), dtype=bool)
    brk[1:] = key[1:] != key[:-1]
    first = np.flatnonzero(brk)
    rid = np.cumsum(brk) - 1
    size = np.diff(np.append(first, len(key)))[rid]  # groups in the (class, round)
    pos = np.arange(len(key)) - first[rid]  # this group's position among them
    i = (pos - (ics[rc[pr]] * 7919) % size) % size  # rotated per class
    i = np.where(rnd % 2 == 0, i, size - 1 - i)  # alternating direction
    out = np.empty(len(key), dtype=np.int64)
    out[first[rid] + i] = rg[pr]
    return out


class StepSamples(NamedTuple):
    """A step's samples sorted by planning class, longest first: per class its first position
    and its count, and the running sums of its members' weights from 0, the classes' runs
    concatenated (class j's run starts at `base[j]`)."""

    offset: dict[int, int]
    count: dict[int, int]
    cumw: np.ndarray
    base: dict[int, int]


class Expansion(NamedTuple):
    """A class-level plan expanded to sample ids: its phases and its predicted step time."""

    phases: list[Phase]
    predicted: float


def expand(
    p: LayoutTable, parts: list[PartPlan], ss: StepSamples, limit: float = math.inf, floors: Sequence[float] = ()
) -> Expansion | None:
    """The phases of a class-level plan and the predicted step time, each micro-batch timed
    by its samples' weights. With a `limit` and the phases' `search.expanded_floors`: None
    as soon as the phases expanded, plus the later phases' floors, are predicted above the
    limit (the expansion could only end there)."""
    cursor = {j: 0 for j in ss.offset}
    predicted = 0.0
    phases: list[Phase] = []
    for x, part in enumerate(parts):
        by_k, count = part.groups
        gclasses = {k: p.deal(by_k[k], count[k]) for k in by_k}
        ph = _dealt_phase(p, part.items, gclasses, ss, cursor)
        _improve(p, ph, gclasses)
        predicted += float(ph.loads().max(initial=0.0))
        phases.append(ph)
        if limit < math.inf and predicted + sum(floors[x + 1 :]) * (1 - p.config.floor_slack) > limit:
            return None
    assert cursor == ss.count, "every sample is planned once"
    return Expansion(phases, predicted)


def _dealt_phase(
    p: LayoutTable, items: list, gclasses: dict[int, list[GroupClass]], ss: StepSamples, cursor: dict[int, int]
) -> Phase:
    """One phase's micro-batches dealt to its groups (widest first; a group class is a range
    of them): each item class's micro-batches cut from its class's samples in order (from
    `cursor`, advanced), each timed by its samples' weights."""
    ranges: list[tuple[int, int, GroupClass]] = []  # (first group, degree, class)
    sizes: list[int] = []
    for k in sorted(gclasses, reverse=True):
        for gc in _by_load(gclasses[k]):
            ranges.append((len(sizes), k, gc))
            sizes.extend([k] * gc.count)
    # per group class and item class it holds: (item class, first group, count, per group)
    ics, per, g0s, cs, held = [], [], [], [], []
    for g0, _, gc in ranges:
        ics.extend(gc.items)
        per.extend(gc.items.values())
        g0s.append(g0)
        cs.append(gc.count)
        held.append(len(gc.items))
    holders = np.column_stack((ics, np.repeat(g0s, held), np.repeat(cs, held), per)).astype(np.int64, copy=False)
    holders = holders[holders[:, 0].argsort(kind="stable")]  # by item class, then group
    grp = deal_orders(holders)
    dealt, at = np.unique(holders[:, 0], return_index=True)
    num = np.add.reduceat(holders[:, 2] * holders[:, 3], at).tolist()
    dealt = dealt.tolist()
    its = [items[ic] for ic in dealt]
    assert num == [it.count for it in its], "every micro-batch of every item class is dealt"
    first = cut_starts(its, cursor)
    t_one = [p.ttab[(it.pclass, it.sp)][it.mbs] / it.mbs for it in its]
    m = np.repeat([it.mbs for it in its], num)
    j = np.repeat([it.pclass for it in its], num)
    within = np.repeat(first, num) + m * (np.arange(len(m)) - np.repeat(np.cumsum(num) - num, num))
    lo = np.repeat([ss.base[it.pclass] for it in its], num) + within
    w = ss.cumw[lo + m] - ss.cumw[lo]
    return Phase(
        sizes,
        grp,
        np.repeat([ss.offset[it.pclass] for it in its], num) + within,
        m,
        j,
        np.repeat(dealt, num),
        np.repeat(t_one, num) * w,
        w / m,
        [p.layout(it.pclass, it.mbs, it.sp).layout for it in items],
    )


def _improve(p: LayoutTable, ph: Phase, gclasses: dict[int, list[GroupClass]]) -> None:
    """The local searches of a dealt phase: `refine` per degree, `spill` across degrees, and
    `refine` again on the degrees spilling changed or that had not settled."""
    deg = np.asarray(ph.sizes)
    of_k = {k: np.flatnonzero(deg == k) for k in gclasses}
    by_group = np.argsort(ph.grp, kind="stable")  # each degree's micro-batches: a range of it
    at = np.searchsorted(ph.grp[by_group], [of_k[k][0] for k in gclasses] + [of_k[k][-1] + 1 for k in gclasses])
    settled = {
        k for x, k in enumerate(gclasses) if refine(ph, of_k[k], by_group[at[x] : at[x + len(gclasses)]], p.config)
    }
    for k in spill(p, ph):
        settled.discard(k)
    for k in gclasses:
        if k not in settled:  # settled: no pair could improve, or its slowest group stopped getting lighter
            refine(ph, of_k[k], config=p.config)


def _by_load(gcs: list[GroupClass]) -> list[GroupClass]:
    """Group classes by load, largest first, equal loads by their contents. `deal_classes`
    returns them in ascending load: where no two loads are equal, that order reversed."""
    if all(a.load < b.load for a, b in zip(gcs, gcs[1:])):
        return gcs[::-1]
    return sorted(gcs, key=lambda c: (-c.load, sorted(c.items.items())))


def build_plan(p: LayoutTable, step: Step, phases: list[Phase], ids: np.ndarray) -> StepPlan:
    """The step plan of an expansion: each phase's groups placed as aligned blocks, each
    running its micro-batches shortest first (`ids`: the step's sample ids in the order the
    micro-batches' `start` positions refer to). The groups stay arrays (`PhaseGroups`) until
    read."""
    out = []
    for ph in phases:
        starts = p.tile_starts(ph.sizes)
        order = run_order(ph)
        ends = np.searchsorted(ph.grp[order], np.arange(len(ph.sizes)), side="right")
        out.append(
            PhaseArrays(tuple(ph.sizes), starts, ends, ph.start[order], ph.m[order], ph.lay[order], tuple(ph.layouts))
        )
    return assemble(p.ctx, step, PhaseGroups(p.world, ids, tuple(out)), ids=ids)


class PhaseArrays(NamedTuple):
    """One phase of a `PhaseGroups`: its groups and their micro-batches in run order."""

    sizes: tuple[int, ...]  #: each group's SP degree, widest first
    starts: tuple[int, ...]  #: each group's first rank (`Topology.tile`: aligned blocks)
    ends: np.ndarray  #: each group's end among the phase's micro-batches
    start: np.ndarray  #: each micro-batch's first position in the step's sorted ids
    m: np.ndarray  #: each micro-batch's samples
    lay: np.ndarray  #: each micro-batch's layout, an index into `layouts`
    layouts: tuple[Layout, ...]


@dataclass(frozen=True)
class PhaseGroups:
    """A `dcp` step's groups as arrays (a `plan.types.GroupSource`), per phase a `PhaseArrays`;
    `ids`: the step's sample ids as sorted for planning. Ranks no group of a phase covers idle
    in groups of one rank (`assemble.with_idle`)."""

    world: int
    ids: np.ndarray
    phases: tuple[PhaseArrays, ...]

    def build(self) -> tuple[GroupPlan, ...]:
        ids = self.ids.tolist()
        groups: list[GroupPlan] = []
        for phase, (sizes, starts, ends, start, m, lay, layouts) in enumerate(self.phases):
            mbs = micro_batches(
                [(tuple(ids[a : a + n]), layouts[li]) for a, n, li in zip(start.tolist(), m.tolist(), lay.tolist())]
            )
            lo = 0
            for k, pos, hi in zip(sizes, starts, ends.tolist()):
                groups.append(GroupPlan(tuple(range(pos, pos + k)), tuple(mbs[lo:hi]), phase))
                lo = hi
        return with_idle(groups, self.world)

    def of_rank(self, rank: int) -> tuple[GroupPlan, ...]:
        out = []
        for phase, (sizes, starts, ends, start, m, lay, layouts) in enumerate(self.phases):
            g = bisect.bisect_right(starts, rank) - 1  # starts ascend on a chain; packed ones may not
            if not (g >= 0 and starts[g] <= rank < starts[g] + sizes[g]):
                g = next((g for g, (k, pos) in enumerate(zip(sizes, starts)) if pos <= rank < pos + k), None)
            if g is None:
                out.append(GroupPlan((rank,), (), phase))
                continue
            lo, hi = (int(ends[g - 1]) if g else 0), int(ends[g])
            mbs = micro_batches(
                [
                    (tuple(self.ids[a : a + n].tolist()), layouts[li])
                    for a, n, li in zip(start[lo:hi].tolist(), m[lo:hi].tolist(), lay[lo:hi].tolist())
                ]
            )
            out.append(GroupPlan(tuple(range(starts[g], starts[g] + sizes[g])), tuple(mbs), phase))
        return tuple(out)

    def holds_once(self, sample_ids: tuple[int, ...]) -> bool:
        """`ids` are the step's samples, and the micro-batches' runs of positions in them tile
        ``range(len(ids))``: each sample planned once."""
        if len(self.ids) != len(sample_ids) or not np.array_equal(np.sort(self.ids), np.sort(sample_ids)):
            return False
        start = np.concatenate([ph.start for ph in self.phases] or [np.zeros(0, np.int64)])
        m = np.concatenate([ph.m for ph in self.phases] or [np.zeros(0, np.int64)])
        order = np.argsort(start, kind="stable")
        start, m = start[order], m[order]
        ends = start + m
        return bool(
            (m > 0).all()
            and int(m.sum()) == len(self.ids)
            and (len(start) == 0 or (start[0] == 0 and (start[1:] == ends[:-1]).all()))
        )

    def busy_sizes(self) -> set[int]:
        return {k for sizes, _, ends, *_ in self.phases for k, n in zip(sizes, np.diff(ends, prepend=0).tolist()) if n}


def run_order(ph: Phase) -> np.ndarray:
    """The phase's micro-batches by group, each group's shortest first (ties by first
    sample position): one sort of packed integer keys (group, rank of time, position) where
    they fit in 63 bits, else a lexicographic sort."""
    n, pos = len(ph.t), int(ph.start.max(initial=0)) + 1
    if len(ph.sizes) * (n + 1) * pos < 2**63:
        rank = np.unique(ph.t, return_inverse=True)[1].reshape(-1)
        return np.argsort((ph.grp * (n + 1) + rank) * pos + ph.start)
    return np.lexsort((ph.start, ph.t, ph.grp))
