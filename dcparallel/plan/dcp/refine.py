"""`dcp`'s local searches over an expanded phase (`Phase`): `refine` balances the
groups of one SP degree by moving or swapping micro-batches between them, `spill` moves
micro-batches off the phase's slowest group to another degree. Both time each micro-batch
from its own samples and keep every micro-batch.

Short names: p (the `tables.LayoutTable`), ph (a `Phase`), a / z (the source and
destination group of a move), g (a group), k (an SP degree), kk (a degree's index among the
phase's), lz (per degree, its least loaded group), top (the slowest group's load), src (the
micro-batches that may move), t (a micro-batch time), gs (a degree's groups), h (a heap of
(load, group)).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from dcparallel.plan.dcp.config import DEFAULT, DcpConfig
from dcparallel.plan.dcp.tables import LayoutTable
from dcparallel.plan.types import BALANCED, MIN_GAIN
from dcparallel.spec import Layout


@dataclass(slots=True)
class Phase:
    """The groups of one phase (SP degrees, widest first) and its micro-batches as arrays:
    each micro-batch's group, first position in the step's sorted sample ids, samples,
    layout (an index into `layouts`), time and its samples' mean weight."""

    sizes: list[int]
    grp: np.ndarray
    start: np.ndarray
    m: np.ndarray
    pclass: np.ndarray
    lay: np.ndarray
    t: np.ndarray
    mw: np.ndarray
    layouts: list[Layout]

    def loads(self) -> np.ndarray:
        return np.bincount(self.grp, weights=self.t, minlength=len(self.sizes))


def spill(p: LayoutTable, ph: Phase, max_iter: int = 256) -> set[int]:
    """Local search across degrees: move a micro-batch off the slowest group of the phase to
    the least-loaded group of another SP degree, re-laid-out there (same samples, that
    degree's recompute for copies of the class's largest sample), while the slowest
    group's load falls. Returns the degrees whose groups it changed.

    A move touches two groups, so passes over all groups cost more than it: heaps of the
    loads (an entry is current while its load is the group's) and per-group lists of
    micro-batches, kept from a first move on; only the slowest group's micro-batches are
    weighed, at every other degree at once. Ties: lower group, narrower degree, earlier."""
    kinds = sorted(set(ph.sizes))
    touched: set[int] = set()
    if len(kinds) < 2 or not _first_move(p, ph, kinds):
        return touched
    loads = ph.loads().tolist()
    n_groups = len(loads)
    size_of = ph.sizes
    slowest, least = _load_heaps(loads, size_of, kinds)
    t_at = None  # [degree, micro-batch] times, once a first move is made
    members: dict[int, list[int]] = {}  # a group's micro-batches, ascending, once it took part in a move
    t_cur = order = bounds = None
    keep = 1 - MIN_GAIN
    for _ in range(max_iter):
        while -slowest[0][0] != loads[slowest[0][1]]:
            heapq.heappop(slowest)
        a = slowest[0][1]
        top = loads[a]
        lz = _least_loaded(least, loads)
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
        new = _left(top, t_old, [lz[kk][0] for kk in open_], t_src)
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
        ph.layouts.append(p.layout(int(ph.pclass[x]), int(ph.m[x]), kinds[kk]).layout)
        ph.grp[x], ph.t[x], ph.lay[x] = z, t, len(ph.layouts) - 1
        t_cur[x] = t
    return touched


def _slots(ph: Phase, gs: np.ndarray, idx: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`refine`'s view of one degree's groups `gs`: its micro-batches sorted by group (`idx`,
    positions in the phase), each one's group as a row, and slots[r, c], the c-th micro-batch
    of the r-th group (-1: empty) as a position in idx, with one spare column."""
    num, g0 = len(gs), int(gs[0])
    if idx is None:
        idx = np.flatnonzero((ph.grp >= g0) & (ph.grp <= gs[-1]))  # a degree's groups are consecutive
        idx = idx[np.argsort(ph.grp[idx], kind="stable")]
    rows = ph.grp[idx] - g0
    counts = np.bincount(rows, minlength=num)
    slot = np.arange(len(idx)) - (counts.cumsum() - counts).repeat(counts)
    slots = np.full((num, int(counts.max(initial=0)) + 1), -1)
    slots[rows, slot] = np.arange(len(idx))
    return idx, rows, slots


def _load_heaps(loads: list[float], size_of: list[int], kinds: list[int]) -> tuple[list, list[list]]:
    """`spill`'s heaps: the groups by load, slowest first, as (-load, group); per degree of
    `kinds` (narrowest first), its groups by load, least first, as (load, group)."""
    slowest = [(-x, g) for g, x in enumerate(loads)]
    heapq.heapify(slowest)
    least = []
    for k in kinds:
        first = size_of.index(k)
        h = [(loads[g], g) for g in range(first, first + size_of.count(k))]
        heapq.heapify(h)
        least.append(h)
    return slowest, least


def _least_loaded(least: list[list], loads: list[float]) -> list[tuple[float, int]]:
    """Per degree, its least loaded group as (load, group), stale heap entries (whose load is
    no longer the group's) dropped on the way."""
    out = []
    for h in least:
        while h[0][0] != loads[h[0][1]]:
            heapq.heappop(h)
        out.append(h[0])
    return out


def _first_move(p: LayoutTable, ph: Phase, kinds: list[int]) -> bool:
    """Whether `spill` makes a first move: its first round with arrays, without the heaps
    (most phases make none, and the heaps cost more than this)."""
    loads = ph.loads()
    a = int(loads.argmax())  # the slowest group, the lowest of ties
    top = loads[a]
    open_, least = [], []
    for k in kinds:
        if k == ph.sizes[a]:
            continue
        g0 = ph.sizes.index(k)
        low = loads[g0 : g0 + ph.sizes.count(k)].min()
        if low < top:
            open_.append(k)
            least.append(low)
    if not open_:
        return False
    src = (ph.grp == a).nonzero()[0]
    return bool(_left(top, ph.t[src], least, _times_at(p, ph, open_, src)).min() < top * (1 - MIN_GAIN))


def _left(top: float, t_old: np.ndarray, least: list[float], t_src: np.ndarray) -> np.ndarray:
    """Per open degree (narrowest first) and micro-batch of the slowest group (in order): the
    larger of the two loads moving it leaves (`least`: each open degree's least load); the
    first least one below the limit wins."""
    return np.maximum(top - t_old, np.array(least)[:, None] + t_src).ravel()


def _members(members: dict[int, list[int]], g: int, order: np.ndarray, bounds: list[int]) -> list[int]:
    """Group g's micro-batches, ascending: kept, or read from the sort by group made at the
    first move (a group not yet in a move still holds what it held then)."""
    got = members.get(g)
    if got is None:
        got = members[g] = sorted(order[bounds[g] : bounds[g + 1]].tolist())
    return got


def _times_at(p: LayoutTable, ph: Phase, kinds: list[int], mbs) -> np.ndarray:
    """The micro-batches `mbs` re-laid-out at every degree of `kinds`: their times there
    ([degree, micro-batch]; inf where one does not fit)."""
    return np.stack([p.ttab_arr[k][ph.pclass[mbs], ph.m[mbs]] for k in kinds]) * ph.mw[mbs]


def refine(ph: Phase, gs: np.ndarray, idx: np.ndarray | None = None, config: DcpConfig = DEFAULT) -> bool:
    """Local search within one SP degree (groups `gs`), with each micro-batch timed from its
    own samples: in rounds, the degree's most loaded groups are paired with its least loaded
    ones, and in every pair one micro-batch moves, or two swap, so that the pair's larger
    load falls as close to their mean as a single move or swap allows; until the most loaded
    group is within 0.1% of the degree's mean load, no pair can improve, or the most loaded
    group has not got lighter for `config.refine_stall` rounds (the rounds after that only balance
    lighter groups: the degree's time is its slowest group's). Returns whether it stopped so
    (settled) rather than after its last round. `idx`: the degree's micro-batches sorted by
    group (stable), if known."""
    if len(gs) < 2:
        return True
    num = len(gs)
    idx, rows, slots = _slots(ph, gs, idx)
    t = ph.t[idx]
    tt = np.append(t, 0.0)  # tt[-1] = 0: an empty slot of the lighter group takes nothing
    ta_of = np.append(t, -np.inf)  # ... and one of the heavier group gives nothing
    loads = np.bincount(rows, weights=t, minlength=num)
    limit = float(loads.sum()) / num * BALANCED  # the mean (np.mean sums the same way)
    changed = settled = False
    top, stall = np.inf, 0
    for _ in range(config.refine_rounds):
        n = min(int((loads > limit).sum()), num // 2, config.refine_pairs)
        if n == 0:
            settled = True
            break
        order = (-loads).argsort(kind="stable")
        ls = loads[order]
        head = ls[0]  # the degree's slowest group
        if head < top:
            top, stall = head, 0
        else:
            stall += 1
            if stall == config.refine_stall:
                settled = True
                break
        a, z = order[:n], order[: -n - 1 : -1]
        la = ls[:n]
        half = (la - ls[: -n - 1 : -1]) / 2
        sz = slots[z]
        # a move or swap of gain g is allowed iff 0 < g < the pair's gap, i.e. iff
        # |g - gap / 2| < gap / 2, the distance it leaves between them (the same test in
        # floats, but for gains below 2^-53 of the gap); the least distance wins
        score = ta_of[slots[a]][:, :, None] - tt[sz][:, None, :]
        score -= half[:, None, None]
        score = np.abs(score, out=score).reshape(n, -1)
        best = score.argmin(axis=1)
        ok = (score[np.arange(n), best] < half) & (half > la * (MIN_GAIN / 2))
        if not ok.all():
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
        r, c = (slots >= 0).nonzero()
        ph.grp[idx[slots[r, c]]] = gs[r]
    return settled
