"""`dcp`'s re-split of a packing between pairs of groups (`Resplit`), for steps of a few
samples per GPU whose classes each hold samples of one size (images of one shape, video
clips of one latent shape).

The per-sample packing cuts each class into micro-batches before it places them (runs of the
preferred size, or of a half or a third of it), so a group's load is a sum of a few fixed
pieces; with two or three micro-batches per rank the groups finish far apart (strong 256-GPU
image buckets: 0.157-0.534 s pieces, two per rank, the last rank 6% above the mean). Here the
slowest group's samples and those of one other group of its degree are pooled and split again
between the two, every class's count on each side its own micro-batch (or a few equal ones,
where that is faster: memory), for the split of the two whose later finish is earliest; the
first partner, fastest first, whose split ends before the slowest group did takes it. Repeated
while the slowest group of the step is a leaf (a group without sub-groups: a top-level one,
or a sub-group, which ends its own micro-batches after its parent's finish) and some leaf of
its degree helps; the packing is kept where its predicted time does not fall.

The pair's split is a dynamic program over the pooled classes (longest copy first), keeping
the states no other state beats on both sides' finishes so far: exact where both sides are
sub-groups; where a side's exposed sync counts, a state dropped could end earlier once a
longer micro-batch hides more of the sync (rarely: within 0.5% on the test's pools). A
class's time for m copies at a degree is `WholeSplit.copies`' (the cost model's, made
non-decreasing in m).

Short names: c (a class index), j (a degree index), n (copies), S (the slowest group), P (a
partner), fin (a group's finish, exposed sync included).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

import numpy as np

from dcparallel.plan.dcp.packing import Group, Packing
from dcparallel.plan.dcp.whole import MAX_COPIES, WholeSplit
from dcparallel.plan.types import MIN_GAIN

#: the most equal micro-batches a class's copies on one group are split into
MAX_PIECES = 8


class Resplit:
    """The re-split of a packing's groups without sub-groups (`improve`), with a
    `WholeSplit`'s classes and copies' times (and its packer's degrees and sync)."""

    def __init__(self, whole: WholeSplit, ids: list[int]):
        self.whole, self.packer = whole, whole.packer
        got = whole.classes(ids)
        self.ok = got is not None and max(len(m) for m in got[0]) <= MAX_COPIES
        if not self.ok:
            return
        self.members, sizes = got
        self.cls = {i: c for c, m in enumerate(self.members) for i in m}
        n = [len(m) for m in self.members]
        self.tau = self.whole.copies(sizes, n, max(n)).tolist()  # [c][j][m - 1]
        self._best: dict[tuple[int, int, int], tuple[float, float, int]] = {}
        self._ex: dict[float, float] = {}  # per longest micro-batch time, the sync it leaves exposed
        self._failed: dict[tuple, float] = {}  # per degree and pair of counts: the finish no split beat
        self._opts: dict[tuple[int, int, int], list] = {}  # per class, degree and count: its two-way splits

    def best(self, c: int, j: int, n: int) -> tuple[float, float, int]:
        """n copies of class c at degree index j in the fewest-seconds of 1..`MAX_PIECES`
        equal micro-batches: (their summed time, the longest one's, how many)."""
        if n == 0:
            return 0.0, 0.0, 0
        key = (c, j, n)
        got = self._best.get(key)
        if got is None:
            row, got = self.tau[c][j], (math.inf, 0.0, 0)
            for k in range(1, min(n, MAX_PIECES) + 1):
                q, r = divmod(n, k)
                t = (k - r) * row[q - 1] + (r * row[q] if r else 0.0)
                if t < got[0]:
                    got = (t, row[q] if r else row[q - 1], k)
            self._best[key] = got
        return got

    def _exposed(self, longest: float) -> float:
        got = self._ex.get(longest)
        if got is None:
            got = self._ex[longest] = self.packer.exposed(longest)
        return got

    def finish(self, j: int, counts: Counter, base: float | None) -> float:
        """When a group of degree index j holding these counts ends: after its base (the
        parent's finish) for a sub-group, else with the sync its longest micro-batch leaves
        exposed."""
        load, longest = 0.0, 0.0
        for c, n in counts.items():
            t, x, _ = self.best(c, j, n)
            load, longest = load + t, max(longest, x)
        return base + load if base is not None else load + self._exposed(longest)

    def improve(self, packing: Packing, rounds: int) -> Packing:
        """The packing with pairs of its leaves (groups without sub-groups: top-level ones,
        and sub-groups after their parent's finish) split again, while the step's slowest
        group is one and a leaf of its degree helps (at most `rounds` times); the packing
        itself where its predicted time does not fall (by `MIN_GAIN`)."""
        if not self.ok:
            return packing
        leaves, top = _leaves(packing.groups)
        if not leaves:  # every sub-group splits again (small worlds: SP 8 -> 4 -> 2): no pair to split
            return packing
        deg = [self.packer.sp.index(g.sp) for g, _ in leaves]
        base = [b for _, b in leaves]
        counts = [Counter(self.cls[i] for it in g.items for i in it) for g, _ in leaves]
        fin = [g.finish for g, _ in leaves]  # the packing's, until a leaf is split again
        order = sorted((f, q) for q, f in enumerate(fin))  # the leaves by finish
        keys = [(b, _key(c)) for b, c in zip(base, counts)]  # what a leaf's splits depend on
        touched: set[int] = set()
        for _ in range(rounds):
            s = order[-1][1]
            if fin[s] <= top:
                break  # a group that is not a leaf ends the step
            got = self._partner(s, deg, base, counts, order, keys)
            if got is None:
                break
            q, a, b = got
            for x, cnt in ((s, a), (q, b)):
                del order[bisect.bisect_left(order, (fin[x], x))]
                counts[x], fin[x], keys[x] = cnt, self.finish(deg[x], cnt, base[x]), (base[x], _key(cnt))
                bisect.insort(order, (fin[x], x))
            touched.update((s, q))
        if not touched or max(order[-1][0], top) >= packing.span * (1 - MIN_GAIN):
            return packing
        return self._packing(packing, leaves, deg, counts, fin, touched)

    def _partner(self, s: int, deg: list[int], base: list, counts: list[Counter], order: list, keys: list):
        """The first leaf of S's degree, fastest first (`order`: the leaves by finish), whose
        pooled split with S ends before S: (its index, S's new counts, its new counts); None
        if none. Leaves of the same counts and base (`keys`) split alike, so each is tried
        once; a pair that did not split before a finish does not before an earlier one
        (`_failed`)."""
        j, mine, end = deg[s], keys[s], order[-1][0]
        tried = set()
        for f, q in order:
            if f >= end:
                return None
            if deg[q] != j:
                continue
            theirs = keys[q]
            if theirs in tried or self._failed.get((j, mine, theirs), -math.inf) >= end:
                continue
            tried.add(theirs)
            got = self.split(j, counts[s] + counts[q], (base[s], base[q]), end)
            if got is not None:
                return (q, *got)
            self._failed[(j, mine, theirs)] = end
        return None

    def split(self, j: int, pool: Counter, bases: tuple, within: float) -> tuple[Counter, Counter] | None:
        """The pooled copies split between two leaves of degree index j (their `bases`) so
        that the later finish is the earliest, if that is before `within`: the two sides'
        counts. A state per split of the classes so far (each side's load and longest
        micro-batch), the states no other beats on both sides' finishes kept; a state where a
        side's load reaches `within` less its base (or the least sync it could leave exposed)
        is dropped."""
        ex = self._exposed
        classes = sorted(pool, key=lambda c: (-self.tau[c][j][0], c))
        least_ex = ex(max(self.tau[c][j][pool[c] - 1] for c in classes))  # no side's micro-batch is longer
        ba, bb = bases
        lim_a, lim_b = (within - (least_ex if b is None else b) for b in bases)
        if sum(self.best(c, j, pool[c])[0] for c in classes) >= lim_a + lim_b:
            return None  # the two loads sum to at least that (a class split costs no less whole)

        def ends(st: tuple) -> tuple[float, float]:
            return (st[0] + (ex(st[1]) if ba is None else ba), st[2] + (ex(st[3]) if bb is None else bb))

        # a state: (load a, longest a, load b, longest b, parent state, copies of the class to a)
        states = [(0.0, 0.0, 0.0, 0.0, None, 0)]
        for c in classes:
            n = pool[c]
            opts = self._opts.get((c, j, n))
            if opts is None:
                opts = self._opts[(c, j, n)] = [
                    (*self.best(c, j, k)[:2], *self.best(c, j, n - k)[:2], k) for k in range(n + 1)
                ]
            new = []
            for st in states:
                la, ga, lb, gb = st[:4]
                for ta, xa, tb, xb, k in opts:
                    if la + ta < lim_a and lb + tb < lim_b:
                        new.append((la + ta, max(ga, xa), lb + tb, max(gb, xb), st, k))
            if not new:
                return None
            states = _front(new, ends)
        best = min(states, key=lambda st: (max(ends(st)), st[0]))
        if max(ends(best)) >= within:
            return None
        a, st = Counter(), best
        for c in reversed(classes):
            if st[5]:
                a[c] = st[5]
            st = st[4]
        b = Counter({c: pool[c] - a[c] for c in classes if pool[c] > a[c]})
        return a, b

    def _packing(self, packing: Packing, leaves: list, deg: list[int], counts, fin, touched: set[int]) -> Packing:
        """The packing with the `touched` leaves holding these counts: each class's samples on
        them dealt to them in order, each leaf's share in its equal micro-batches (`best`),
        the longest last; the other groups as they were."""
        p = self.packer
        held: dict[int, list[int]] = {}  # per class, the touched leaves' samples
        for x in sorted(touched):
            for i in (i for it in leaves[x][0].items for i in it):
                held.setdefault(self.cls[i], []).append(i)
        for v in held.values():
            v.sort()
        taken = dict.fromkeys(held, 0)
        new: dict[int, Group] = {}  # per leaf's id, its new group
        for x in sorted(touched):
            j, items = deg[x], []
            for c in sorted(counts[x]):
                n, k = counts[x][c], self.best(c, j, counts[x][c])[2]
                ids = held[c][taken[c] : taken[c] + n]
                taken[c] += n
                ends = np.linspace(0, n, k + 1).round().astype(int).tolist()
                items += [(self.tau[c][j][b - a - 1], tuple(ids[a:b])) for a, b in zip(ends[:-1], ends[1:])]
            items.sort()
            new[id(leaves[x][0])] = Group(p.sp[j], fin[x], [it for _, it in items], [])
        groups = [_rebuilt(g, new) for g in packing.groups]
        groups.sort(key=lambda g: (-g.sp, -g.finish, g.items[0] if g.items else ()))
        return Packing(groups, max(_tree_finish(g) for g in groups))


def _leaves(groups: list[Group]) -> tuple[list[tuple[Group, float | None]], float]:
    """The packing's leaves, each with its base (None for a top-level group, its parent's
    finish for a sub-group), and the latest finish of the rest: parents' own, and the trees
    under a sub-group that has sub-groups of its own."""
    leaves, top = [], 0.0
    for g in groups:
        if not g.subgroups:
            leaves.append((g, None))
            continue
        top = max(top, g.finish)
        for k in g.subgroups:
            if k.subgroups:
                top = max(top, _tree_finish(k))
            else:
                leaves.append((k, g.finish))
    return leaves, top


def _front(states: list[tuple], ends) -> list[tuple]:
    """The states no other ends earlier on both sides (`ends`: their finishes so far)."""
    keyed = sorted((*ends(st), i) for i, st in enumerate(states))
    out, best_b = [], math.inf
    for _, fb, i in keyed:
        if fb < best_b:
            out.append(states[i])
            best_b = fb
    return out


def _rebuilt(g: Group, new: dict[int, Group]) -> Group:
    """Group g with its leaves replaced by their new groups (`new`, by the old one's id).
    (A function, not a nested one: a recursive closure is a reference cycle, and planning
    makes none.)"""
    got = new.get(id(g))
    return got if got is not None else Group(g.sp, g.finish, g.items, [_rebuilt(k, new) for k in g.subgroups])


def _key(counts: Counter) -> tuple:
    return tuple(sorted(counts.items()))


def _tree_finish(g: Group) -> float:
    return max([g.finish] + [_tree_finish(c) for c in g.subgroups])
