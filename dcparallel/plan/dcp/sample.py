"""`dcp`'s per-sample packing, for steps with few samples per GPU (and, in micro-batches of
each class's preferred size, for steps with a heavy tail of long samples).

With about one sample per GPU or fewer, most groups run one or two samples, and the class
level (every sample of a class laid out for the class's largest, group loads estimated
from mean weights) leaves groups that finish far apart. Here each sample is timed alone at
every SP degree, and for a makespan target T:

1. every sample takes the degree of fewest GPU-seconds among those at which it finishes
   within T (wider SP adds communication, narrower may need recomputation);
2. samples, longest first, are packed into groups of capacity T. At each degree from the
   sample's own upward (re-timed there), the sample goes into the fullest open group of that
   degree it still fits in, else into a wider open group with room, which *splits*: its
   block becomes equal sub-groups of that degree, run before the parent's own micro-batches
   (the parent waits for them and takes no more members; the other sub-groups stay open for
   later samples). A sample that fits nowhere opens a new group of its own degree. A group's
   finish counts the gradient sync its longest micro-batch's backward cannot hide
   (`cost.overlap`): a group of many short samples must end earlier;
3. the smallest T whose groups fit the world wins, searched from a floor no target below
   packs (the longest micro-batch, the GPU-seconds over the world) up at widening steps,
   then by bisection over the samples' times in the last step and below the first of them
   that packs; ranks left over then widen the slowest group, or split its samples over a second group,
   while that lowers the makespan. Each group runs its longest sample last, so the gradient
   sync overlaps the longest backward.

Sub-groups fill the time a wide group leaves after a long sample with short samples at their
own narrow degree (re-timed at the wide one they would spend more GPU-seconds). A plan with
sub-groups has one phase per level: the deepest run in phase 0, the top-level groups last.

The step is packed several ways: one sample per micro-batch, in micro-batches of each
class's preferred size (the least GPU-seconds per sample: several short samples or video
clips of one shape share a micro-batch), or in runs of a half and a third of that size; each
placed longest first by GPU-seconds, or by time, or by GPU-seconds opening new groups before
re-timing into wider ones (`pack`'s `open_first`). No one way packs every step tightest; the
fastest packing is returned (each way seeks only packings faster than the best before it,
so the most promising go first: `plan`). One sample per micro-batch is tried only with at most
`config.one_per_gpu` samples per GPU (with more, micro-batches of preferred size pack tighter
on the scale report's steps), the finer runs with at most `config.split_per_gpu`: where a
group runs a few micro-batches, whole preferred ones (up to half the step each) leave groups
finishing far apart, and finer ones, which spend a little more GPU-time, fill them evenly
(strong 256-GPU video steps of 2.7-3.8 samples per GPU: 0.86-0.89 of the bound with preferred
sizes alone, 0.93-0.96 with the finer runs).

Steps of many samples per GPU with a heavy tail (a few documents of 0.5-1M tokens beside
thousands of short ones) are packed in micro-batches of preferred size only (`plan`'s
`max_items`): the sub-groups fill each long document's wide group after it with short ones
at their narrow degrees, where the class level keeps a group's degree for a whole phase.

Deterministic (ties broken by sample id), so every rank computes the same plan.

Short names: t (per micro-batch and degree, its time alone), f (the same with the sync it
leaves exposed), T (a makespan target), cap (T with rounding slack), a (a micro-batch's
row), b / d (a degree index: the micro-batch's own, the one it is timed at), g (a group's
index), k (an SP degree), w (a wider degree index), nar (each micro-batch's degree index by
the layout rule), own (its time there).
"""

from __future__ import annotations

import bisect
import heapq
import math
from itertools import repeat
from typing import Callable, Sequence

import numpy as np

from dcparallel.cost.overlap import exposed_sync, exposed_sync_many, sync_buckets
from dcparallel.plan.assemble import lpt
from dcparallel.plan.context import MAX_MBS, FitGrid, PlanContext, RecomputeMode
from dcparallel.plan.dcp.config import DEFAULT, DcpConfig
from dcparallel.plan.dcp.packing import Group, Node, Packing, Prices, step_plan
from dcparallel.plan.dcp.tables import least_gpu_seconds_within
from dcparallel.plan.dcp.targets import search_targets
from dcparallel.plan.steps import Step
from dcparallel.plan.types import MIN_GAIN, TIME_EPS, StepPlan
from dcparallel.spec import Layout


class SamplePacker:
    """The per-sample packing of a step (`plan`) on the context's chain of SP degrees."""

    def __init__(self, ctx: PlanContext, mode: RecomputeMode, config: DcpConfig = DEFAULT):
        self.ctx, self.mode, self.config = ctx, mode, config
        self.sp = list(ctx.sp_sizes)
        self.world = ctx.cluster.world_size
        self.kf = np.asarray(self.sp, dtype=float)
        self._priced: dict[tuple[int, ...], tuple[FitGrid, int]] = {}  # per micro-batch `times` priced: grid, row
        self._layouts: dict[tuple[int, int, int, int], Layout] = {}  # equal layouts shared (immutable)
        self.sync = ctx.cost.grad_sync_time()
        #: the gradient sync's buckets (`cost.overlap.sync_buckets`): how much of it a backward hides
        cl = ctx.cluster
        self.sync_buckets = sync_buckets(ctx.cost.model.trainable_params, cl.shard_size, cl.world_size)

    def exposed(self, last: float) -> float:
        """The sync a group leaves exposed when its last (longest) micro-batch takes `last`."""
        return exposed_sync(self.sync, last, self.sync_buckets)

    def items(self, ids: Sequence[int], max_items: int | None = None, split: int = 1) -> list[tuple[int, ...]] | None:
        """The step's samples as micro-batches: per class, runs of its preferred micro-batch
        size (the least GPU-seconds per sample; 1 for long samples) divided by `split`
        (rounded up), longest first; None if more than `max_items`."""
        keys, at = self.ctx.bucket_positions()
        arr = np.asarray(ids, dtype=np.int64)
        bpos = at[arr]
        count = np.bincount(bpos, minlength=len(keys))
        held = count.nonzero()[0].tolist()
        if max_items is not None and len(ids) > max_items:  # counted in arrays first (many samples)
            if int((-(-count[held] // [self._preferred(keys[j], split) for j in held])).sum()) > max_items:
                return None
        # by class (in key order), longest first, then by id
        members = arr[np.lexsort((arr, -self.ctx.token_array()[arr], bpos))].tolist()
        out, start = [], 0
        for j in held:
            m, end = self._preferred(keys[j], split), start + int(count[j])
            out.extend(tuple(members[a : min(a + m, end)]) for a in range(start, end, m))
            start = end
        return out

    def _preferred(self, b, split: int = 1) -> int:
        """Class b's preferred micro-batch size (`PlanContext.preferred`), at most `MAX_MBS`,
        divided by `split` (rounded up). The class level forms the larger micro-batches of
        launch-bound classes (up to `MAX_COPIES`); as the packing's items they made its target
        search no better and slower (weak 1024-GPU text/pretrain-long: 106 -> 137 ms a step)."""
        return -(-min(self.ctx.preferred(b, self.mode).layout.mbs, MAX_MBS) // split)

    def times(self, items: Sequence[tuple[int, ...]]) -> np.ndarray:
        """Per micro-batch and degree, its time alone (inf where it does not fit), all priced
        at once (`PlanContext.fits_grid`); the recompute counts are kept for `step_plan`."""
        fits = self.ctx.fits_grid(items, self.sp, self.mode)
        self._priced.update(zip(items, zip(repeat(fits), range(len(items)))))
        return fits.time

    def alone(self, t: np.ndarray) -> np.ndarray:
        """Per sample and degree, when the sample alone finishes, its exposed sync included."""
        return t + exposed_sync_many(self.sync, t, self.sync_buckets)

    def ranks_short(self, t: np.ndarray, f: np.ndarray, T: float) -> bool:
        """Whether no packing at target T fits the world, by a count `pack` need not make:
        some micro-batch finishes within T at no degree, or the micro-batches longer than T / 2
        at every degree where they fit in T need more ranks than the world. Two of those
        cannot share a rank (a rank's micro-batches, its sub-groups' included, run within T),
        so each holds at least its narrowest such degree's ranks alone. True for T implies
        True for every smaller target (degrees only drop out, more micro-batches are long)."""
        cap = T * (1 + TIME_EPS)
        if not (f <= cap).any(axis=1).all():
            return True
        fits = t <= cap
        long = ~(fits & (t <= cap / 2)).any(axis=1)
        if not long.any():
            return False
        narrowest = self.kf[fits[long].argmax(axis=1)]  # its first degree where it fits
        return float(narrowest.sum()) > self.world

    def pack(
        self,
        ids: list[int],
        t: np.ndarray,
        f: np.ndarray,
        T: float,
        by_time: bool = False,
        open_first: bool = False,
        memo: dict | None = None,
    ) -> list[Node] | None:
        """Groups (`Node`s; sub-groups follow their parent) for target T: every group's
        finish stays within T. None if a micro-batch cannot finish within T or the top-level
        groups need more ranks than the world. Rows are micro-batches; `ids`: each one's
        first sample id (ties). `open_first`: a micro-batch that fits no group of its own
        degree opens a new one while the world has ranks for it, before it is re-timed into
        a wider group (which spends more GPU-seconds, but fewer ranks). `memo`: what packings
        of the same `ids`, `t` and `f` at other targets share (`_placing_order`'s, and the
        sync each longest member time leaves exposed)."""
        cap = T * (1 + TIME_EPS)
        memo = {} if memo is None else memo
        got = self._placing_order(ids, t, f, cap, by_time, memo)
        return None if got is None else self._place(got, cap, open_first, memo.setdefault("exposed", {}))

    def _place(self, got: tuple, cap: float, open_first: bool, exposed: dict[float, float]) -> list[Node] | None:
        """`pack`'s placing of the micro-batches, for the target with its slack `cap`. `got`:
        `_placing_order`'s (the order, whether each follows one of its degree and time, each
        one's degree index, the rows). A run of micro-batches of one degree and
        time (video clips of one shape) fills each group it meets in one pass: each of them
        would find that group the fullest with room, until it is full, then the next fullest.
        `exposed`: per longest member time, the sync it leaves exposed (`exposed`'s, kept)."""
        order, same, nl, tl = got
        groups: list[Node] = []
        # per degree index, the open groups' finishes, sorted, with their indices
        fins: list[list[tuple[float, int]]] = [[] for _ in self.sp]
        put, fit = self._placers(groups, fins, cap, exposed)
        bisect_right, insort, inf = bisect.bisect_right, bisect.insort, math.inf
        ranks, p, n = 0, 0, len(order)
        while p < n:
            a = order[p]
            p += 1
            b = nl[a]
            row = tl[a]
            need = row[b]
            lst = fins[b]
            room = cap - need
            if not (lst and lst[0][0] <= room):  # no room at its own degree
                ranks = self._elsewhere(groups, put, fit, a, b, row, cap, open_first, ranks)
                if ranks > self.world:
                    return None
                continue
            # `fit`'s first case and `put`, written out (the inner loop)
            i = bisect_right(lst, (room, inf)) - 1  # the fullest open group of its degree with room
            while True:
                g = lst[i][1]
                grp = groups[g]
                grp.load += need
                grp.rows.append(a)
                if need > grp.longest:
                    grp.longest = need
                if grp.base is None:
                    ex = exposed.get(grp.longest)
                    if ex is None:
                        ex = exposed[grp.longest] = self.exposed(grp.longest)
                else:
                    ex = grp.base
                fin = grp.load + ex
                # the micro-batches after it of the same degree and time go where it went
                # while the group has room for them (it stays the fullest with room)
                while p < n and same[p] and fin <= room:
                    a = order[p]
                    p += 1
                    grp.load += need
                    grp.rows.append(a)
                    fin = grp.load + ex
                new = (fin, g)
                if i + 1 == len(lst) or new < lst[i + 1]:
                    lst[i] = new  # its place in the sorted list is unchanged: no pop and insort
                else:
                    del lst[i]
                    insort(lst, new, i)  # (the groups before it finish earlier still)
                if not (i and p < n and same[p]):
                    break
                # the next of them goes to the next fullest group (before i: within room)
                i -= 1
                a = order[p]
                p += 1
        return groups

    def _elsewhere(self, groups, put, fit, a: int, b: int, row: list[float], cap, open_first, ranks):
        """`_place`'s micro-batch a (its degree index b, its times `row`) where no open
        group of its degree has room: into a wider open group, split into sub-groups of its
        degree (`fit`); else, with `open_first` and the world's ranks for it, a new group of its
        degree; else into an open group of a wider degree it is re-timed at; else a new group.
        Returns the ranks the top-level groups hold (past the world: no packing, none placed)."""
        sp = self.sp
        g = fit(b, row[b])
        if g is None and open_first and ranks + sp[b] <= self.world:
            ranks += sp[b]
            groups.append(Node(b, 0.0, [], 0.0, None, []))
            g = len(groups) - 1
        d = b
        while g is None and d + 1 < len(sp):  # re-timed at a wider degree
            d += 1
            if row[d] <= cap:
                g = fit(d, row[d])
        if g is not None:
            put(g, a, row[d])
            return ranks
        ranks += sp[b]
        if ranks <= self.world:
            groups.append(Node(b, 0.0, [], 0.0, None, []))
            put(len(groups) - 1, a, row[b])
        return ranks

    def _placers(self, groups: list[Node], fins: list[list[tuple[float, int]]], cap: float, exposed: dict):
        """`pack`'s two moves on its groups and their open lists `fins` (per degree index, the
        open groups' finishes, sorted, with their indices), for the target with its slack `cap`:
        `put(g, a, need)` adds micro-batch a, taking `need`, to group g and reopens the group;
        `fit(d, need)` finds a group for it (below). Closures over local state: the packing's
        inner loop looks up no attribute per micro-batch. `exposed`: per longest member time,
        the sync it leaves exposed (shared with `pack`'s loop)."""
        sp = self.sp
        wider = [self.split_degrees(d) for d in range(len(sp))]
        bisect_right, insort = bisect.bisect_right, bisect.insort

        def put(g: int, a: int, need: float) -> None:
            grp = groups[g]
            grp.load += need
            grp.rows.append(a)
            if need > grp.longest:
                grp.longest = need
            if grp.base is None:
                ex = exposed.get(grp.longest)
                if ex is None:
                    ex = exposed[grp.longest] = self.exposed(grp.longest)
                insort(fins[grp.deg], (grp.load + ex, g))
            else:
                insort(fins[grp.deg], (grp.load + grp.base, g))

        def fit(d: int, need: float) -> int | None:
            """An open group of degree index d with room for `need`, else a wider open group
            with room, split into sub-groups of degree d (its ranks run them first); the first
            sub-group is returned, the others stay open. None if neither."""
            # the fullest open group whose finish is within `room` (a member longer than the
            # group's longest only hides more sync) is taken out of its degree's open list
            room = cap - need
            lst = fins[d]
            if lst and lst[0][0] <= room:
                return lst.pop(bisect_right(lst, (room, len(groups))) - 1)[1]
            for w in wider[d]:
                lst = fins[w]
                if lst and lst[0][0] <= room:
                    p = lst.pop(bisect_right(lst, (room, len(groups))) - 1)[1]
                    base = self.finish(groups[p])  # the parent takes no more members
                    kids = list(range(len(groups), len(groups) + sp[w] // sp[d]))
                    groups[p].kids = kids
                    groups.extend(Node(d, 0.0, [], 0.0, base, []) for _ in kids)
                    for c in kids[1:]:
                        insort(fins[d], (base, c))
                    return kids[0]
            return None

        return put, fit

    def _placing_order(
        self, ids: list[int], t: np.ndarray, f: np.ndarray, cap: float, by_time: bool, memo: dict
    ) -> tuple[list[int], list[bool], list[int], list[list[float]]] | None:
        """`pack`'s order of the micro-batches (longest first: by GPU-seconds, or `by_time` by
        time, at their own degree, then by id), per position in it whether the micro-batch
        there has the previous one's degree and time, each one's own degree index (the layout
        rule's within `cap`; its time there is its row's at it), and `t` as lists; None if one
        finishes within `cap` at no degree, or if the micro-batches cannot fit the world's
        GPU-seconds (`too_much_work`). The targets of one search mostly give every micro-batch
        the same degree:
        `memo` keeps the order per degrees chosen, and `t`'s lists (the same for all)."""
        if not (f <= cap).any(axis=1).all():
            return None
        # the degree of fewest GPU-seconds within T (narrow SP may need recomputation), narrowest on ties
        gpu_s = t * self.kf
        nar = least_gpu_seconds_within(gpu_s, f, cap)
        if self.too_much_work(t, gpu_s, nar, cap):
            return None
        key = (by_time, nar.tobytes())
        got = memo.get(key)
        if got is None:
            own = t[np.arange(len(ids)), nar]
            order = np.lexsort((np.asarray(ids), -own if by_time else -own * self.kf[nar]))
            same = np.zeros(len(order), dtype=bool)
            same[1:] = (nar[order[1:]] == nar[order[:-1]]) & (own[order[1:]] == own[order[:-1]])
            if "rows" not in memo:
                memo["rows"] = t.tolist()
            got = memo[key] = (order.tolist(), same.tolist(), nar.tolist(), memo["rows"])
        return got

    def too_much_work(self, t: np.ndarray, gpu_s: np.ndarray, nar: np.ndarray, cap: float) -> bool:
        """Whether no packing at `cap` exists, by GPU-seconds: `pack` places each micro-batch
        at its own degree `nar` or a wider one where it takes at most `cap`, d ranks for its
        time t there; each rank lies in one top-level group's block and runs its micro-batches
        (its sub-groups' before its group's) within the group's finish, within `cap`; so a
        packing's micro-batches take at most world x cap GPU-seconds, and at least the sum of
        each one's least GPU-seconds at those degrees. Above that, `pack` would fail, after
        placing most of them (on steps as tight as the search's first targets). The margin
        (1e-12 of it) is far above the sum's rounding (a few units of 2**-53 of it)."""
        deg = np.arange(len(self.sp))
        least = np.where((t <= cap) & (deg >= nar[:, None]), gpu_s, np.inf).min(axis=1)
        return float(least.sum()) > self.world * cap * (1 + 1e-12)

    def split_degrees(self, d: int) -> range:
        """The degree indices whose open groups with room may split into sub-groups of degree
        index d: every wider one."""
        return range(d + 1, len(self.sp))

    def finish(self, g: Node) -> float:
        """When a group's ranks are done: a top-level group adds the sync its longest member
        leaves exposed; a sub-group starts at its base (see `Node`)."""
        return g.load + (self.exposed(g.longest) if g.base is None else g.base)

    def tree_finish(self, groups: list[Node], g: int) -> float:
        """When a top-level group and all its sub-groups are done."""
        return max([self.finish(groups[g])] + [self.tree_finish(groups, c) for c in groups[g].kids])

    def widen(self, groups: list[Node], t: np.ndarray) -> None:
        """Ranks left over go to the group that finishes last: a group of one micro-batch
        moves to the next degree of the chain (when it fits there), a group of several splits its samples over a
        second group of its degree; while the makespan falls."""
        roots = [i for i, g in enumerate(groups) if g.base is None]
        free = self.world - sum(self.sp[groups[i].deg] for i in roots)
        heap = [(-self.tree_finish(groups, i), groups[i].deg, i) for i in roots]  # the last to finish first
        heapq.heapify(heap)
        while free > 0 and heap:
            neg, _, i = heapq.heappop(heap)
            g, top = groups[i], -neg
            k = self.sp[g.deg]
            if g.kids:
                return  # a group with sub-groups keeps its degree
            if len(g.rows) == 1:
                b = g.deg + 1  # the next degree of the chain
                a = g.rows[0]
                if (
                    b >= len(self.sp)
                    or self.sp[b] - k > free
                    or not t[a, b] + self.exposed(t[a, b]) < top * (1 - MIN_GAIN)
                ):
                    return
                g.deg, g.load, g.longest = b, float(t[a, b]), float(t[a, b])
                heapq.heappush(heap, (-self.finish(g), g.deg, i))
                free -= self.sp[b] - k
            else:
                if k > free:
                    return
                times = t[g.rows, g.deg].tolist()  # its samples, longest first to the lighter of two
                deal, loads = lpt(times, 2, dealt_order=True)
                parts = [
                    Node(g.deg, load, [g.rows[j] for j in d], max([0.0] + [times[j] for j in d]), None, [])
                    for d, load in zip(deal, loads)
                ]
                if max(self.finish(q) for q in parts) >= top * (1 - MIN_GAIN):
                    return
                groups[i] = parts[0]
                groups.append(parts[1])
                for j in (i, len(groups) - 1):
                    heapq.heappush(heap, (-self.finish(groups[j]), groups[j].deg, j))
                free -= k

    def plan(
        self, ids: list[int], max_items: int | None = None, beat: Callable[[], float] | None = None
    ) -> Packing | None:
        """The groups (widest first) and the predicted step time (exposed sync included) of
        the best target over the ways of `ways`, each in three orders (see the module
        docstring); the fastest of these. With `max_items` (steps of many samples per GPU,
        where each way costs the most and, on the scale report's heavy-tail steps, the other
        orders pack no tighter), one order only, opening new groups first (`pack`'s
        `open_first`), and None if there are more micro-batches of preferred size than that.
        Only packings faster than `beat()` (another plan's predicted time, asked once there is
        something to pack) and than the ways before are sought: a way stops where no target
        up to that packs, most often at its first packing. So the ways most likely to pack
        tightest go first: without `max_items` (a few micro-batches per group), new groups
        opened first, and the finest runs first; with it, preferred sizes first on text and
        last on video. On the weak 1024-GPU tails of the CPU-time report, the fastest packing
        came from the finer runs opening new groups first on most few-per-GPU steps, and
        with many samples per GPU from the half or third runs on video (by 1-7%: a
        preferred video micro-batch holds several clips of one shape) and from preferred
        sizes on text (the ways within 0.1% there); so one full target search runs where
        two to four did with preferred sizes, in the plain order, first."""
        if not ids:
            return None
        self._priced = {}
        ways = self.ways(ids, max_items)
        if ways is None:
            return None
        timed = [(items, self.times(items)) for items in ways]
        beaten = math.inf if beat is None else beat()
        best = None
        if max_items is None:
            timed.reverse()  # the finest runs first, one sample per micro-batch, preferred sizes last
            orders = ((False, True), (False, False), (True, False))
        else:
            orders = ((False, True),)
            if self.ctx.model.kind == "video":  # the half runs, the third runs, preferred sizes last
                timed = timed[1:] + timed[:1]
        for by_time, open_first in orders:
            for items, t in timed:
                ceiling = min(beaten, math.inf if best is None else best.span) * (1 - MIN_GAIN)
                got = self._plan_items(items, t, by_time, open_first, ceiling)
                if got is not None and (best is None or got.span < best.span * (1 - MIN_GAIN)):
                    best = got
        return best

    def ways(self, ids: list[int], max_items: int | None = None) -> list[list[tuple[int, ...]]] | None:
        """The micro-batches `plan` packs the step's samples in, one list per way: those of
        preferred size (None if more than `max_items`); one sample each (without `max_items`,
        with at most `config.one_per_gpu` samples per GPU); with at most
        `config.split_per_gpu` samples per GPU, runs of the preferred size divided by each of
        `config.pack_splits` (finer micro-batches: groups of few of them finish closer together)."""
        merged = self.items(ids, max_items)
        if merged is None:
            return None
        ways = [merged]
        if max_items is None and (len(merged) == len(ids) or len(ids) <= self.config.one_per_gpu * self.world):
            ways = ([merged] if len(merged) < len(ids) else []) + [[(i,) for i in ids]]
        if len(ids) <= self.config.split_per_gpu * self.world:
            for split in self.config.pack_splits:
                finer = self.items(ids, max_items, split)
                if finer is not None and all(finer != w for w in ways):
                    ways.append(finer)
        return ways

    def _plan_items(
        self, items: list[tuple[int, ...]], t: np.ndarray, by_time: bool, open_first: bool, ceiling: float = math.inf
    ) -> Packing | None:
        ids = [it[0] for it in items]
        f = self.alone(t)
        fast = f.min(axis=1)
        if not np.isfinite(fast).all():
            return None
        # no target below this packs: every micro-batch finishes within it, and the groups'
        # GPU-seconds (at least each micro-batch's least) fit world x target
        floor = max(float(fast.max()), float(np.min(t * self.kf, axis=1).sum()) / self.world)
        if floor >= ceiling or (ceiling < math.inf and self.ranks_short(t, f, ceiling)):
            return None  # no packing of these finishes earlier than the ceiling
        packed: dict[float, list[Node] | None] = {}  # per target: the search and the final pass share them
        memo: dict = {}  # what the packings at every target share (`pack`)

        def pack(T: float) -> list[Node] | None:
            if T not in packed:
                packed[T] = self.pack(ids, t, f, T, by_time, open_first, memo)
            return packed[T]

        targets = search_targets(pack, f, floor, ceiling, self.config)
        if targets is None:
            return None
        best: list[Node] | None = None
        best_span = math.inf
        for T in targets:
            got = pack(T)
            if got is None:
                continue
            groups = [g.copy() for g in got]  # widened in place
            self.widen(groups, t)
            span = max(self.finish(g) for g in groups)
            if best is None or span < best_span * (1 - MIN_GAIN):
                best, best_span = groups, span
        rows = memo["rows"]  # `t` as lists (a packing was made: its order put them there)
        top = [self._group(best, i, items, rows, ids) for i, g in enumerate(best) if g.base is None]
        top.sort(key=lambda g: (-g.sp, -g.finish, g.items[0]))
        return Packing(top, best_span)

    def _group(
        self, groups: list[Node], i: int, items: list[tuple[int, ...]], t: list[list[float]], ids: list[int]
    ) -> Group:
        """Packed group i with its sub-groups; longest last: the gradient sync overlaps the
        last micro-batch's backward. (Methods, not nested functions: a recursive closure is a
        reference cycle, and planning makes none.)"""
        g = groups[i]
        order = sorted(g.rows, key=lambda a: (t[a][g.deg], ids[a]))
        return Group(
            self.sp[g.deg],
            self.finish(g),
            [items[a] for a in order],
            [self._group(groups, c, items, t, ids) for c in g.kids],
        )

    def step_plan(self, step: Step, groups: list[Group], times: list[float] | None = None) -> StepPlan:
        """The step plan of packed groups (`packing.step_plan`); `times`, if given, is filled
        with each micro-batch's time as `times` priced it, in the plan's order."""
        return step_plan(Prices(self.ctx, self.sp, self.mode, self._priced, self._layouts), step, groups, times)
