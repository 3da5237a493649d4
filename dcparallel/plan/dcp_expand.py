"""`dcp`'s expansion of a chosen class-level plan to sample ids and plan objects.

Micro-batches are dealt to groups, refined with each micro-batch's own time, moved across SP
degrees, and placed on ranks.

Each bucket's samples, longest first, are cut into its micro-batches and dealt round by round
to the groups holding that bucket (so every group gets a mix of its bucket's longer and
shorter samples); groups are placed as aligned blocks, largest first (a group no larger than
a node stays inside one; a larger one spans nodes and the cost model charges the link), and
each group runs its micro-batches shortest first, so its longest backward hides the most of
the gradient sync. The micro-batches of a phase are numpy arrays (`Phase`): a few array
operations per item class and refinement round (a spill move, touching two groups, is plain
Python). Plan objects (`MicroBatch`, `GroupPlan`) are built only for the expansion kept.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dcparallel.plan.dcp_classes import GroupClass, cut_starts
from dcparallel.plan.dcp_setup import memo
from dcparallel.plan.steps import Step
from dcparallel.plan.types import BALANCED, MIN_GAIN, GroupPlan, StepPlan, micro_batches
from dcparallel.spec import Layout

if TYPE_CHECKING:
    from dcparallel.plan.dcp_scale import ScalePlanner

#: refinement rounds per SP degree; each round pairs up to REFINE_PAIRS of the degree's most
#: loaded groups with its least loaded ones and moves or swaps one micro-batch in every pair
REFINE_ROUNDS = 16
REFINE_PAIRS = 256
#: the placements of the last few distinct group-size lists are kept (steps often repeat them)
TILE_CACHE_LIMIT = 64


@dataclass(slots=True)
class Phase:
    """The groups of one phase (SP degrees, widest first) and its micro-batches as arrays:
    each micro-batch's group, first position in the step's sorted sample ids, samples,
    layout (an index into `layouts`), time and its samples' mean weight."""

    sizes: list[int]
    grp: np.ndarray
    start: np.ndarray
    m: np.ndarray
    bucket: np.ndarray
    lay: np.ndarray
    t: np.ndarray
    mw: np.ndarray
    layouts: list[Layout]

    def loads(self) -> np.ndarray:
        return np.bincount(self.grp, weights=self.t, minlength=len(self.sizes))


def deal_orders(held: list[tuple[int, list[tuple[int, int, int]]]]) -> np.ndarray:
    """The group of each micro-batch of every item class `ic` of `held`, in sample order, the
    classes concatenated in their order there: round by round over the groups still holding
    some of the class (`holders`: first group, count, micro-batches per group), alternating
    direction and rotated per class, so each group gets longer and shorter samples of the
    bucket. In a few array operations: each (group, round) pair is one micro-batch, placed by
    its position among its class's groups in that round."""
    hc = np.repeat(np.arange(len(held)), [len(h) for _, h in held])
    g0, n, per = np.fromiter(chain.from_iterable(x for _, h in held for x in h), dtype=np.int64).reshape(-1, 3).T
    ics = np.array([ic for ic, _ in held], dtype=np.int64)
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


def expand(p: ScalePlanner, parts, ss: StepSamples) -> tuple[list[Phase], float]:
    """The phases of a class-level plan and the predicted step time, each micro-batch timed
    by its samples' weights."""
    cursor = {j: 0 for j in ss.offset}
    predicted = 0.0
    phases: list[Phase] = []
    for _, items, (by_k, count), _ in parts:
        gclasses = {k: p.deal(by_k[k], count[k]) for k in by_k}
        # every group of the phase, widest first; a group class is a range of them
        ranges: list[tuple[int, int, GroupClass]] = []  # (first group, degree, class)
        sizes: list[int] = []
        for k in sorted(gclasses, reverse=True):
            for gc in _by_load(gclasses[k]):
                ranges.append((len(sizes), k, gc))
                sizes.extend([k] * gc.count)
        held: dict[int, list[tuple[int, int, int]]] = {}  # item class -> its groups (first, count, per group)
        for g0, _, gc in ranges:
            for ic, q in gc.items.items():
                if q:
                    held.setdefault(ic, []).append((g0, gc.count, q))
        # each item class's micro-batches cut from its bucket's samples in order (a cursor per
        # bucket), dealt to its groups
        dealt = [(ic, held[ic]) for ic in range(len(items)) if ic in held]
        grp = deal_orders(dealt)
        num = [sum(n * q for _, n, q in h) for _, h in dealt]
        its = [items[ic] for ic, _ in dealt]
        assert num == [it.count for it in its], "every micro-batch of every item class is dealt"
        first = cut_starts(its, cursor)
        t_one = [p.ttab[(it.bucket, it.sp)][it.mbs] / it.mbs for it in its]
        m = np.repeat([it.mbs for it in its], num)
        j = np.repeat([it.bucket for it in its], num)
        within = np.repeat(first, num) + m * (np.arange(len(m)) - np.repeat(np.cumsum(num) - num, num))
        lo = np.repeat([ss.base[it.bucket] for it in its], num) + within
        w = ss.cumw[lo + m] - ss.cumw[lo]
        ph = Phase(sizes, grp, np.repeat([ss.offset[it.bucket] for it in its], num) + within, m, j,
                   np.repeat([ic for ic, _ in dealt], num), np.repeat(t_one, num) * w, w / m,
                   [p._lt(it.bucket, it.mbs, it.sp)[0] for it in items])
        deg = np.asarray(sizes)
        of_k = {k: np.flatnonzero(deg == k) for k in gclasses}
        by_group = np.argsort(grp, kind="stable")  # each degree's micro-batches: a range of it
        at = np.searchsorted(grp[by_group], [of_k[k][0] for k in gclasses] + [of_k[k][-1] + 1 for k in gclasses])
        settled = {k for x, k in enumerate(gclasses)
                   if refine(ph, of_k[k], by_group[at[x]:at[x + len(gclasses)]])}
        for k in spill(p, ph):
            settled.discard(k)
        for k in gclasses:
            if k not in settled:  # refining a settled degree again would change nothing
                refine(ph, of_k[k])
        predicted += float(ph.loads().max(initial=0.0))
        phases.append(ph)
    assert cursor == ss.count, "every sample is planned once"
    return phases, predicted


def _by_load(gcs: list[GroupClass]) -> list[GroupClass]:
    """Group classes by load, largest first, equal loads by their contents. `deal_classes`
    returns them in ascending load: where no two loads are equal, that order reversed."""
    if all(a.load < b.load for a, b in zip(gcs, gcs[1:])):
        return gcs[::-1]
    return sorted(gcs, key=lambda c: (-c.load, sorted(c.items.items())))


def build_plan(p: ScalePlanner, step: Step, phases: list[Phase], num_tokens: int, ids: np.ndarray) -> StepPlan:
    """The step plan of an expansion: each phase's groups placed as aligned blocks, each
    running its micro-batches shortest first (`ids`: the step's sample ids in the order the
    micro-batches' `start` positions refer to). The groups stay arrays (`PhaseGroups`) until
    read."""
    out = []
    for ph in phases:
        memo(p._tiles, tuple(ph.sizes), partial(p.ctx.topology.tile, ph.sizes), TILE_CACHE_LIMIT)  # validates
        order = run_order(ph)
        ends = np.searchsorted(ph.grp[order], np.arange(len(ph.sizes)), side="right")
        out.append((tuple(ph.sizes), ends, ph.start[order], ph.m[order], ph.lay[order], tuple(ph.layouts)))
    return StepPlan(step.index, step.sample_ids, PhaseGroups(p.world, ids, tuple(out)), num_tokens)


@dataclass(frozen=True)
class PhaseGroups:
    """A `dcp` step's groups as arrays (a `plan.types.GroupSource`): per phase, its group sizes
    (widest first, placed as aligned blocks from rank 0 on; ranks past them are idle groups of
    one rank), each group's end among the phase's micro-batches, and the micro-batches in run
    order: first position in `ids` (the step's sample ids as sorted for planning), samples,
    layout (an index into the phase's layouts)."""

    world: int
    ids: np.ndarray
    phases: tuple[tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[Layout, ...]], ...]

    def build(self) -> tuple[GroupPlan, ...]:
        ids = self.ids.tolist()
        groups: list[GroupPlan] = []
        for phase, (sizes, ends, start, m, lay, layouts) in enumerate(self.phases):
            mbs = micro_batches([(tuple(ids[a:a + n]), layouts[li])
                                 for a, n, li in zip(start.tolist(), m.tolist(), lay.tolist())])
            lo = pos = 0
            for k, hi in zip(sizes, ends.tolist()):
                groups.append(GroupPlan(tuple(range(pos, pos + k)), tuple(mbs[lo:hi]), phase))
                lo, pos = hi, pos + k
            groups.extend(GroupPlan((r,), (), phase) for r in range(pos, self.world))
        return tuple(groups)

    def of_rank(self, rank: int) -> tuple[GroupPlan, ...]:
        out = []
        for phase, (sizes, ends, start, m, lay, layouts) in enumerate(self.phases):
            tops = np.cumsum(sizes)
            g = int(np.searchsorted(tops, rank, side="right"))
            if g == len(sizes):
                out.append(GroupPlan((rank,), (), phase))
                continue
            lo, hi = (int(ends[g - 1]) if g else 0), int(ends[g])
            mbs = micro_batches([(tuple(self.ids[a:a + n].tolist()), layouts[li]) for a, n, li in
                                 zip(start[lo:hi].tolist(), m[lo:hi].tolist(), lay[lo:hi].tolist())])
            pos = int(tops[g]) - sizes[g]
            out.append(GroupPlan(tuple(range(pos, pos + sizes[g])), tuple(mbs), phase))
        return tuple(out)

    def busy_sizes(self) -> set[int]:
        return {k for sizes, ends, *_ in self.phases for k, n in zip(sizes, np.diff(ends, prepend=0).tolist()) if n}


def run_order(ph: Phase) -> np.ndarray:
    """The phase's micro-batches by group, each group's shortest first (ties by first
    sample position): one sort of packed integer keys (group, rank of time, position) where
    they fit in 63 bits, else a lexicographic sort."""
    n, pos = len(ph.t), int(ph.start.max(initial=0)) + 1
    if len(ph.sizes) * (n + 1) * pos < 2 ** 63:
        rank = np.unique(ph.t, return_inverse=True)[1].reshape(-1)
        return np.argsort((ph.grp * (n + 1) + rank) * pos + ph.start)
    return np.lexsort((ph.start, ph.t, ph.grp))


def spill(p: ScalePlanner, ph: Phase, max_iter: int = 256) -> set[int]:
    """Local search across degrees: move a micro-batch off the slowest group of the phase to
    the least-loaded group of another SP degree, re-laid-out there (same samples, that
    degree's recompute for copies of the bucket's largest sample), while the slowest
    group's load falls. Returns the degrees whose groups it changed.

    A move touches two groups, so passes over all groups cost more than it: heaps of the
    loads (an entry is current while its load is the group's) and per-group lists of
    micro-batches, kept from a first move on; only the slowest group's micro-batches are
    weighed, at every other degree at once. Ties: lower group, narrower degree, earlier."""
    kinds = sorted(set(ph.sizes))
    touched: set[int] = set()
    if len(kinds) < 2:
        return touched
    loads = ph.loads().tolist()
    n_groups = len(loads)
    size_of = ph.sizes
    first = {k: size_of.index(k) for k in kinds}
    slowest = [(-x, g) for g, x in enumerate(loads)]
    heapq.heapify(slowest)
    least = []  # per degree, narrowest first: its groups' (load, group)
    for k in kinds:
        h = [(loads[g], g) for g in range(first[k], first[k] + size_of.count(k))]
        heapq.heapify(h)
        least.append(h)
    t_at = None  # [degree, micro-batch] times, once a first move is made
    members: dict[int, list[int]] = {}  # a group's micro-batches, ascending, once it took part in a move
    t_cur = order = bounds = None
    keep = 1 - MIN_GAIN
    for _ in range(max_iter):
        while -slowest[0][0] != loads[slowest[0][1]]:
            heapq.heappop(slowest)
        a = slowest[0][1]
        top = loads[a]
        lz = []
        for h in least:
            while h[0][0] != loads[h[0][1]]:
                heapq.heappop(h)
            lz.append(h[0])
        open_ = [kk for kk, k in enumerate(kinds) if k != size_of[a] and lz[kk][0] < top]
        if not open_:
            return touched
        if t_at is None:
            src = np.flatnonzero(ph.grp == a)
            t_src = _times_at(p, ph, [kinds[kk] for kk in open_], src)
            t_old = ph.t[src]
        else:
            src = np.array(_members(members, a, order, bounds))
            t_src = t_at[np.array(open_)[:, None], src]
            t_old = t_cur[src]
        # per open degree (narrowest first) and micro-batch (in order): the larger of the two
        # loads a move leaves; the first least one below the limit wins
        new = np.maximum(top - t_old, np.array([lz[kk][0] for kk in open_])[:, None] + t_src).ravel()
        best = int(new.argmin())
        if not new[best] < top * keep:
            return touched
        row, i = divmod(best, len(src))
        kk = open_[row]
        z = lz[kk][1]
        touched |= {size_of[a], kinds[kk]}
        if t_at is None:
            t_at = _times_at(p, ph, kinds, slice(None))
            t_cur = ph.t.copy()
            order = np.argsort(ph.grp, kind="stable")
            bounds = np.searchsorted(ph.grp[order], np.arange(n_groups + 1)).tolist()
            _members(members, a, order, bounds)
        x, t = int(src[i]), float(t_src[row, i])
        members[a].remove(x)
        bisect.insort(_members(members, z, order, bounds), x)
        loads[a] -= float(t_cur[x])
        loads[z] += t
        heapq.heappush(slowest, (-loads[a], a))
        heapq.heappush(slowest, (-loads[z], z))
        heapq.heappush(least[kinds.index(size_of[a])], (loads[a], a))
        heapq.heappush(least[kk], (loads[z], z))
        ph.layouts.append(p._lt(int(ph.bucket[x]), int(ph.m[x]), kinds[kk])[0])
        ph.grp[x], ph.t[x], ph.lay[x] = z, t, len(ph.layouts) - 1
        t_cur[x] = t
    return touched


def _members(members: dict[int, list[int]], g: int, order: np.ndarray, bounds: list[int]) -> list[int]:
    """Group g's micro-batches, ascending: kept, or read from the sort by group made at the
    first move (a group not yet in a move still holds what it held then)."""
    got = members.get(g)
    if got is None:
        got = members[g] = sorted(order[bounds[g]:bounds[g + 1]].tolist())
    return got


def _times_at(p: ScalePlanner, ph: Phase, kinds: list[int], mbs) -> np.ndarray:
    """The micro-batches `mbs` re-laid-out at every degree of `kinds`: their times there
    ([degree, micro-batch]; inf where one does not fit)."""
    return np.stack([p.ttab_arr[k][ph.bucket[mbs], ph.m[mbs]] for k in kinds]) * ph.mw[mbs]


def refine(ph: Phase, gs: np.ndarray, idx: np.ndarray | None = None) -> bool:
    """Local search within one SP degree (groups `gs`), with each micro-batch timed from its
    own samples: in rounds, the degree's most loaded groups are paired with its least loaded
    ones, and in every pair one micro-batch moves, or two swap, so that the pair's larger
    load falls as close to their mean as a single move or swap allows; until the most loaded
    group is within 0.1% of the degree's mean load or no pair can improve. Returns whether it
    stopped so (settled) rather than after its last round. `idx`: the degree's micro-batches
    sorted by group (stable), if known."""
    if len(gs) < 2:
        return True
    num, g0 = len(gs), int(gs[0])
    if idx is None:
        idx = np.flatnonzero((ph.grp >= g0) & (ph.grp <= gs[-1]))  # a degree's groups are consecutive
        idx = idx[np.argsort(ph.grp[idx], kind="stable")]
    rows = ph.grp[idx] - g0
    counts = np.bincount(rows, minlength=num)
    slot = np.arange(len(idx)) - np.repeat(np.cumsum(counts) - counts, counts)
    # slots[r, c]: the c-th micro-batch of the degree's r-th group (-1: empty), as positions
    # in idx; one spare column
    slots = np.full((num, int(counts.max(initial=0)) + 1), -1)
    slots[rows, slot] = np.arange(len(idx))
    t = ph.t[idx]
    tt = np.append(t, 0.0)  # tt[-1] = 0: an empty slot of the lighter group takes nothing
    ta_of = np.append(t, -np.inf)  # ... and one of the heavier group gives nothing
    loads = np.bincount(rows, weights=t, minlength=num)
    limit = float(loads.sum()) / num * BALANCED  # the mean (np.mean sums the same way)
    changed = settled = False
    for _ in range(REFINE_ROUNDS):
        n = min(int(np.count_nonzero(loads > limit)), num // 2, REFINE_PAIRS)
        if n == 0:
            settled = True
            break
        order = (-loads).argsort(kind="stable")
        a, z = order[:n], order[:-n - 1:-1]
        la = loads[a]
        half = (la - loads[z]) / 2
        sz = slots[z]
        # a move or swap of gain g is allowed iff 0 < g < the pair's gap, i.e. iff
        # |g - gap / 2| < gap / 2, the distance it leaves between them (the same test in
        # floats, but for gains below 2^-53 of the gap); the least distance wins
        score = ta_of[slots[a]][:, :, None] - tt[sz][:, None, :]
        score -= half[:, None, None]
        score = np.abs(score, out=score).reshape(n, -1)
        best = score.argmin(axis=1)
        ok = (score[np.arange(n), best] < half) & (half > la * (MIN_GAIN / 2))
        if not ok.any():
            settled = True
            break
        a, z, best = a[ok], z[ok], best[ok]
        i, jz = np.divmod(best, sz.shape[1])
        out_a, out_z = slots[a, i], slots[z, jz]
        g = tt[out_a] - tt[out_z]
        loads[a] -= g
        loads[z] += g
        if (out_z < 0).any() and (slots[z[out_z < 0]] < 0).sum(axis=1).min() <= 1:
            slots = np.pad(slots, ((0, 0), (0, 1)), constant_values=-1)  # keep a spare empty slot
        slots[a, i] = out_z
        slots[z, jz] = out_a
        changed = True
    if changed:
        r, c = np.nonzero(slots >= 0)
        ph.grp[idx[slots[r, c]]] = gs[r]
    return settled
