"""`dcp`'s per-sample packing, for steps with few samples per GPU.

With about one sample per GPU or fewer, most groups run one or two samples, and the class
level (every sample of a bucket laid out for the bucket's largest, group loads estimated
from mean weights) leaves groups that finish far apart. Here each sample is timed alone at
every SP degree, and for a makespan target T:

1. every sample takes the degree of fewest GPU-seconds among those at which it finishes
   within T (wider SP adds communication, narrower may need recomputation);
2. samples, longest first, are packed into groups of capacity T: into the fullest open group
   of their degree they still fit in, else into the fullest wider group they fit in
   (re-timed at its degree), else into a new group of their degree. A group's finish counts
   the gradient sync its longest micro-batch's backward cannot hide (`cost.overlap`): a group
   of many short samples must end earlier;
3. the smallest T (bisection over the samples' times) whose groups fit the world wins;
   ranks left over then widen the slowest group, or split its samples over a second group,
   while that lowers the makespan. Each group runs its longest sample last, so the gradient
   sync overlaps the longest backward.

The step is packed twice: one sample per micro-batch, and in micro-batches of each bucket's
preferred size (the least GPU-seconds per sample: several short samples or video clips of
one shape share a micro-batch); the faster packing is returned.

Deterministic (ties broken by sample id), so every rank computes the same plan.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

import numpy as np

from dcparallel.cost.overlap import exposed_sync, exposed_sync_many, num_buckets
from dcparallel.plan.context import PlanContext, RecomputeMode
from dcparallel.plan.steps import Step
from dcparallel.plan.types import MIN_GAIN, TIME_EPS, GroupPlan, MicroBatch, StepPlan

#: bisection steps for the makespan target between two of the samples' times
CONTINUOUS_STEPS = 8

#: one group: (SP degree, predicted finish, its micro-batches' sample ids in run order)
Group = tuple[int, float, list[tuple[int, ...]]]


class SamplePacker:
    def __init__(self, ctx: PlanContext, mode: RecomputeMode):
        self.ctx, self.mode = ctx, mode
        self.sp = list(ctx.sp_sizes)
        self.world = ctx.cluster.world_size
        self.kf = np.asarray(self.sp, dtype=float)
        self._mbs: dict = {}  # per bucket, its preferred micro-batch size
        self.sync = ctx.cost.grad_sync_time()
        self.buckets = num_buckets(ctx.cost.model.num_params)

    def exposed(self, last: float) -> float:
        """The sync a group leaves exposed when its last (longest) micro-batch takes `last`."""
        return exposed_sync(self.sync, last, self.buckets)

    def items(self, ids: Sequence[int]) -> list[tuple[int, ...]]:
        """The step's samples as micro-batches: per bucket, runs of its preferred micro-batch
        size (the least GPU-seconds per sample; 1 for long samples), longest first."""
        ctx = self.ctx
        by: dict = {}
        for i in ids:
            by.setdefault(ctx.bucket_of[i], []).append(i)
        out = []
        for b in sorted(by):
            m = self._mbs.get(b)
            if m is None:
                opts = ctx.bucket_options(b, self.mode)
                m = self._mbs[b] = opts[min(opts, key=lambda k: (opts[k].gpu_s_per_sample, k))].layout.mbs
            members = sorted(by[b], key=lambda i: (-ctx.tokens[i], i))
            out.extend(tuple(members[a:a + m]) for a in range(0, len(members), m))
        return out

    def times(self, items: Sequence[tuple[int, ...]]) -> np.ndarray:
        """Per micro-batch and degree, its time alone (inf where it does not fit)."""
        ctx = self.ctx
        rows: dict = {}  # per distinct sizes (video steps repeat a few shapes)
        t = np.full((len(items), len(self.sp)), np.inf)
        for a, item in enumerate(items):
            sizes = tuple(ctx.sizes[i] for i in item)
            row = rows.get(sizes)
            if row is None:
                row = rows[sizes] = [np.inf] * len(self.sp)
                for b, k in enumerate(self.sp):
                    fit = ctx.layout_for(sizes, k, self.mode)  # the bounded cache the simulator also uses
                    if fit is not None:
                        row[b] = fit.time
            t[a] = row
        return t

    def alone(self, t: np.ndarray) -> np.ndarray:
        """Per sample and degree, when the sample alone finishes, its exposed sync included."""
        return t + exposed_sync_many(self.sync, t, self.buckets)

    def pack(self, ids: list[int], t: np.ndarray, f: np.ndarray, T: float) -> list[list] | None:
        """Groups [degree index, load, member rows, longest member time] for target T (a
        group's load plus the sync its longest member leaves exposed stays within T), or None
        if a micro-batch cannot finish within T or the groups need more ranks than the world.
        Rows are micro-batches; `ids`: each one's first sample id (ties)."""
        cap = T * (1 + TIME_EPS)
        ok = f <= cap
        if not ok.any(axis=1).all():
            return None
        # the degree of fewest GPU-seconds within T (narrow SP may need recomputation), narrowest on ties
        nar = np.where(ok, t * self.kf, np.inf).argmin(axis=1)
        own = t[np.arange(len(ids)), nar]
        # longest first: by GPU-seconds at the narrowest degree, then id
        order = sorted(range(len(ids)), key=lambda a: (-own[a] * self.sp[nar[a]], ids[a]))
        groups: list[list] = []
        # per degree index, the open groups' finishes (load + exposed sync), sorted, with their indices
        fins: list[list[tuple[float, int]]] = [[] for _ in self.sp]
        ranks = 0
        for a in order:
            placed = False
            for b in range(nar[a], len(self.sp)):
                need = t[a, b]
                if not np.isfinite(need):
                    continue
                lst = fins[b]
                # the fullest group with room: the largest finish <= T - need (a member longer
                # than the group's longest only hides more sync)
                pos = bisect.bisect_right(lst, (cap - need, len(groups))) - 1
                if pos < 0:
                    continue
                _, g = lst.pop(pos)
                grp = groups[g]
                grp[1] += need
                grp[2].append(a)
                grp[3] = max(grp[3], need)
                bisect.insort(lst, (grp[1] + self.exposed(grp[3]), g))
                placed = True
                break
            if placed:
                continue
            b = nar[a]
            ranks += self.sp[b]
            if ranks > self.world:
                return None
            groups.append([b, own[a], [a], own[a]])
            bisect.insort(fins[b], (f[a, b], len(groups) - 1))
        return groups

    def finish(self, g: list) -> float:
        return g[1] + self.exposed(g[3])

    def widen(self, groups: list[list], t: np.ndarray) -> None:
        """Ranks left over go to the group that finishes last: a group of one micro-batch
        moves to the next degree of the chain (when it fits there), a group of several splits its samples over a
        second group of its degree; while the makespan falls."""
        free = self.world - sum(self.sp[g[0]] for g in groups)
        heap = [(-self.finish(g), g[0], i) for i, g in enumerate(groups)]  # the last to finish first
        heapq.heapify(heap)
        while free > 0 and heap:
            neg, _, i = heapq.heappop(heap)
            g, top = groups[i], -neg
            k = self.sp[g[0]]
            if len(g[2]) == 1:
                b = g[0] + 1  # the next degree of the chain
                a = g[2][0]
                if b >= len(self.sp) or self.sp[b] - k > free or \
                        not t[a, b] + self.exposed(t[a, b]) < top * (1 - MIN_GAIN):
                    return
                g[0], g[1], g[3] = b, float(t[a, b]), float(t[a, b])
                heapq.heappush(heap, (-self.finish(g), g[0], i))
                free -= self.sp[b] - k
            else:
                if k > free:
                    return
                parts: list[list] = [[g[0], 0.0, [], 0.0], [g[0], 0.0, [], 0.0]]
                for a in sorted(g[2], key=lambda a: -t[a, g[0]]):  # longest first to the lighter
                    q = parts[0] if parts[0][1] <= parts[1][1] else parts[1]
                    q[1] += t[a, g[0]]
                    q[2].append(a)
                    q[3] = max(q[3], t[a, g[0]])
                if max(self.finish(q) for q in parts) >= top * (1 - MIN_GAIN):
                    return
                g[:] = parts[0]
                groups.append(parts[1])
                for j in (i, len(groups) - 1):
                    heapq.heappush(heap, (-self.finish(groups[j]), groups[j][0], j))
                free -= k

    def plan(self, ids: list[int]) -> tuple[list[Group], float] | None:
        """The groups (widest first) and the predicted step time (exposed sync included) of
        the best target, packing samples one per micro-batch or, when buckets prefer more,
        in micro-batches of their preferred size; the faster of the two."""
        if not ids:
            return None
        best = self._plan_items([(i,) for i in ids])
        merged = self.items(ids)
        if len(merged) < len(ids):
            other = self._plan_items(merged)
            if other is not None and (best is None or other[1] < best[1] * (1 - MIN_GAIN)):
                best = other
        return best

    def _plan_items(self, items: list[tuple[int, ...]]) -> tuple[list[Group], float] | None:
        ids = [it[0] for it in items]
        t = self.times(items)
        f = self.alone(t)
        fast = f.min(axis=1)
        if not np.isfinite(fast).all():
            return None
        ts = np.unique(f[np.isfinite(f) & (f >= float(fast.max()))])
        packed: dict[float, list[list] | None] = {}  # per target: the search and the final pass share them

        def pack(T: float) -> list[list] | None:
            if T not in packed:
                packed[T] = self.pack(ids, t, f, T)
            return packed[T]

        top = float(ts[-1])
        for _ in range(64):  # more samples than groups at their own times: targets of several samples each
            if pack(top) is not None:
                break
            top *= 2
        else:
            return None
        if top > ts[-1]:
            ts = np.append(ts, top)
        lo, hi = 0, len(ts) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if pack(float(ts[mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        targets = [float(ts[i]) for i in range(lo, min(lo + 3, len(ts)))]  # not monotone in T: a few above
        if lo > 0:  # below the first feasible time the degrees stay those of the time before: bisect T there
            a, b = float(ts[lo - 1]), float(ts[lo])
            for _ in range(CONTINUOUS_STEPS):
                mid = (a + b) / 2
                if pack(mid) is not None:
                    b = mid
                else:
                    a = mid
            targets.append(b)
        best = None
        for T in targets:
            got = pack(T)
            if got is None:
                continue
            groups = [[g[0], g[1], list(g[2]), g[3]] for g in got]  # widened in place
            self.widen(groups, t)
            span = max(self.finish(g) for g in groups)
            if best is None or span < best[1] * (1 - MIN_GAIN):
                best = (groups, span)
        groups, span = best
        # longest last: the gradient sync overlaps the last micro-batch's backward
        out = [(self.sp[g[0]], self.finish(g), [items[a] for a in sorted(g[2], key=lambda a: (t[a, g[0]], ids[a]))])
               for g in groups]
        out.sort(key=lambda g: (-g[0], -g[1], g[2][0]))
        return out, span

    def step_plan(self, step: Step, groups: list[Group]) -> StepPlan:
        """The step plan of packed groups, placed as aligned blocks (widest first)."""
        ctx = self.ctx
        out = []
        for g, ranks in enumerate(ctx.topology.tile([k for k, _, _ in groups])):
            mbs: tuple = ()
            if g < len(groups):
                k = groups[g][0]
                mbs = tuple(MicroBatch(item, ctx.layout_for(tuple(ctx.sizes[i] for i in item), k, self.mode).layout)
                            for item in groups[g][2])
            out.append(GroupPlan(ranks, mbs, 0))
        return StepPlan(step.index, step.sample_ids, tuple(out), ctx.step_tokens(step.sample_ids))
