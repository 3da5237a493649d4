"""`dcp`'s per-sample planner (`PerSamplePlanner`): cheap on small clusters and steps, it
mixes SP degrees within a class, which the class level does not (`portfolio.PerSample`
offers its plans up to `DcpConfig.per_sample_max_world` GPUs). Its options without balance,
promotion or phases are the paper's ablations (`plan/research/dcp_v1.py`).

For each step:
1. every class of the step takes its own layout: the SP degree and micro-batch size of
   least GPU-seconds per sample that fit memory (`intra`); with `promote`, a class whose
   micro-batch would outlast the step's average load per rank moves to the smallest
   larger SP degree that finishes within it (a long sample must not stall the step);
2. the world is split into groups per SP degree, greedily giving one more group to the
   SP degree whose groups would finish last, until no rank is left or nothing improves;
   groups of mixed sizes tile the world as aligned blocks (largest first);
3. micro-batches are dealt to the groups of their SP degree: round-robin by count
   (without `balance`), or longest first to the least-loaded group (`balance`: per-group
   gradient accumulation), followed by moves of micro-batches off the slowest group to any
   group where they finish earlier, re-laid-out at that group's SP degree;
4. recomputation per micro-batch: `fit` (none if it fits, else full) or `pac` (the
   cheapest partial recompute that fits the memory left, a knapsack over layers x
   {attention, MLP});
5. with `phases`, the step may also run in two phases on the same ranks: first the
   micro-batches of SP degree >= k on their groups, then the narrower ones on groups of
   their own, for each k among the step's degrees; the plan with the earliest predicted
   end is kept. One phase has to give every degree its own groups at once, so a sample
   that needs a group as wide as the world drags the step's short samples onto that
   group too; two phases let the short ones run narrow, in parallel, after it.

Short names: b (a class: the context's bucket), k (an SP degree), n (groups), c (a candidate's degree per class).
"""

from __future__ import annotations

from typing import NamedTuple

from dcparallel.plan.assemble import assemble, lpt, round_robin
from dcparallel.plan.context import Option, PlanContext, RecomputeMode
from dcparallel.plan.steps import Step
from dcparallel.plan.types import MIN_GAIN, REL_TOL, TIME_EPS, Chunk, GroupPlan, MicroBatch, StepPlan


class Groups(NamedTuple):
    """One phase's groups: their sizes, each one's micro-batches, the predicted compute makespan."""

    sizes: list[int]
    mbs: list[list[Chunk]]
    span: float


class Move(NamedTuple):
    """A move of `_steal`: the larger load it leaves, the micro-batch's position on the slowest
    group, the group it goes to, what stays behind (half of a split micro-batch, or None) and
    what moves."""

    end: float
    index: int
    dst: int
    keep: Chunk | None
    moved: Chunk


class PerSamplePlanner:
    """The per-sample planner of a step (`plan`); `name` is the policy it plans for."""

    def __init__(
        self, ctx: PlanContext, *, name: str, mode: RecomputeMode, balance: bool, promote: bool, phases: bool = False
    ):
        self.ctx, self.name, self.mode, self.balance, self.promote = ctx, name, mode, balance, promote
        self.phases = phases
        self.options: dict[tuple[int, int], dict[int, Option]] = {b: ctx.bucket_options(b, mode) for b in ctx.rep}
        self.preferred = {b: ctx.preferred(b, mode).layout.sp for b in ctx.rep}

    def describe(self) -> dict:
        return {"recompute": self.mode, "balance": self.balance, "promote": self.promote, "phases": self.phases}

    # -- 1. layouts --------------------------------------------------------------------
    def _choose_sp(self, by_class: dict[tuple[int, int], list[int]]) -> dict[tuple[int, int], int]:
        sp = {b: self.preferred[b] for b in by_class}
        if not self.promote:
            return sp
        ctx = self.ctx
        work = sum(len(ids) * self.options[b][sp[b]].gpu_s_per_sample for b, ids in by_class.items())
        avg = work / ctx.cluster.world_size
        for b, ids in by_class.items():
            opts = self.options[b]
            # the time of the class's largest micro-batch in this step at each degree
            mb_time = {
                k: ctx.copies_layout(ctx.rep[b], min(len(ids), o.layout.mbs), k, self.mode).time
                for k, o in opts.items()
                if k >= sp[b]
            }
            if mb_time[sp[b]] <= avg:
                continue
            within = [k for k in sorted(mb_time) if mb_time[k] <= avg]
            sp[b] = within[0] if within else min(mb_time, key=lambda k: (mb_time[k], k))
        return sp

    def _chunk(self, ids: list[int], b: tuple[int, int], k: int) -> list[Chunk]:
        """The class's samples in micro-batches of its micro-batch size at SP degree k; each
        micro-batch gets the recompute setting its own samples need (a partial or shorter
        micro-batch may keep more activations than the class's largest would)."""
        ctx = self.ctx
        m = self.options[b][k].layout.mbs
        out = []
        for s in range(0, len(ids), m):
            chunk = tuple(ids[s : s + m])
            fit = ctx.layout_for(tuple(ctx.sizes[i] for i in chunk), k, self.mode)
            assert fit is not None, "a class's layout fits its largest sample, so it fits these"
            out.append(Chunk(chunk, fit.layout, fit.time))
        return out

    # -- 2. groups per SP degree ---------------------------------------------------------
    def _makespan(self, times: list[float], n: int) -> float:
        if not times:
            return 0.0
        if self.balance:
            return max(lpt(times, n)[1])
        return max(sum(times[j] for j in deal) for deal in round_robin(len(times), n))

    def _allocate(self, times: dict[int, list[float]], world: int) -> tuple[dict[int, int], int]:
        """Groups per SP degree minimizing the step's makespan: the smallest makespan T for
        which the groups each degree needs to finish within T fit the world (every
        degree's makespan is non-increasing in its group count, so scan the candidate
        T values in order). Ranks left over go, a group at a time, to the degree that
        finishes last while that helps."""
        spans = {}
        for k, ts in times.items():
            row, n_max = [], min(world // k, len(ts))
            for n in range(1, n_max + 1):
                row.append(self._makespan(ts, n))
            spans[k] = row
        candidates = sorted({t for row in spans.values() for t in row})
        lo, hi = 0, len(candidates) - 1  # the largest candidate is always feasible
        while lo < hi:
            mid = (lo + hi) // 2
            need = sum(
                k * next(n for n, t in enumerate(spans[k], 1) if t <= candidates[mid] or n == len(spans[k]))
                for k in spans
            )
            if need <= world and all(spans[k][-1] <= candidates[mid] for k in spans):
                hi = mid
            else:
                lo = mid + 1
        target = candidates[lo]
        count = {k: next(n for n, t in enumerate(spans[k], 1) if t <= target) for k in spans}
        free = world - sum(k * n for k, n in count.items())
        while free > 0:
            open_ = [k for k in spans if k <= free and count[k] < len(spans[k])]
            if not open_:
                break
            k = max(open_, key=lambda j: spans[j][count[j] - 1])
            if spans[k][count[k]] >= spans[k][count[k] - 1] - TIME_EPS:
                break
            count[k] += 1
            free -= k
        return count, free

    def plan(self, step: Step) -> StepPlan:
        """Plans with each class at its preferred SP degree and, when promotion changes any,
        with long classes promoted; each in one phase and, with `phases`, split in two at
        each SP degree; keeps whichever finishes the step first."""
        ctx = self.ctx
        by_class: dict[tuple[int, int], list[int]] = {}
        for i in step.sample_ids:
            by_class.setdefault(ctx.bucket_of[i], []).append(i)
        preferred = {b: self.preferred[b] for b in by_class}
        candidates = [preferred]
        if self.promote:
            promoted = self._choose_sp(by_class)
            if promoted != preferred:
                candidates.append(promoted)
        best: list[Groups] | None = None  # the phases predicted to end first
        best_end = 0.0
        for c in candidates:
            splits = [[by_class]]
            if self.phases:
                for k in sorted(set(c.values()))[1:]:
                    splits.append(
                        [
                            {b: ids for b, ids in by_class.items() if c[b] >= k},
                            {b: ids for b, ids in by_class.items() if c[b] < k},
                        ]
                    )
            for parts in splits:
                phases = [self._groups(part, {b: c[b] for b in part}) for part in parts]
                end = sum(ph.span for ph in phases)
                if best is None or end < best_end * (1 - REL_TOL):
                    best, best_end = phases, end
        groups = []
        for phase, (group_sizes, group_mbs, _) in enumerate(best):
            order = sorted(range(len(group_sizes)), key=lambda g: -group_sizes[g])
            ranks = ctx.topology.tile([group_sizes[g] for g in order])
            groups.extend(
                GroupPlan(r, tuple(MicroBatch(c.sample_ids, c.layout) for c in group_mbs[g]), phase)
                for r, g in zip(ranks, order)
            )
        return assemble(ctx, step, groups)

    def _groups(self, by_class: dict[tuple[int, int], list[int]], sp_of: dict[tuple[int, int], int]) -> Groups:
        """The groups of one phase holding these classes at these SP degrees."""
        ctx = self.ctx
        world = ctx.cluster.world_size

        def build_classes() -> dict[int, list[Chunk]]:
            classes: dict[int, list] = {}
            for b, ids in by_class.items():
                for item in self._chunk(ids, b, sp_of[b]):
                    classes.setdefault(item.layout.sp, []).append(item)
            return classes

        classes = build_classes()
        # one group per SP degree must fit the world: fold the least-work degree upward
        while sum(classes) > world:
            ks = sorted(classes)
            work = {k: sum(c.time for c in classes[k]) * k for k in ks}
            k_small = min(ks[:-1], key=lambda k: (work[k], k))
            k_up = next(k for k in ks if k > k_small)
            for b in by_class:
                if sp_of[b] == k_small:
                    sp_of[b] = k_up if k_up in self.options[b] else max(self.options[b])
            classes = build_classes()

        count, free = self._allocate({k: [c.time for c in v] for k, v in classes.items()}, world)

        # -- 3. deal micro-batches to groups ------------------------------------------
        group_sizes: list[int] = []
        group_mbs: list[list[Chunk]] = []
        for k in sorted(classes, reverse=True):
            n = count[k]
            items = classes[k]
            if self.balance:
                assign, _ = lpt([c.time for c in items], n)
            else:
                assign = round_robin(len(items), n)
            for g in range(n):
                group_sizes.append(k)
                group_mbs.append([items[j] for j in assign[g]])
        # ranks no SP degree could use become groups of the smallest size, which moving
        # (and splitting) micro-batches off the slowest groups can then fill
        k = ctx.sp_sizes[0]
        while free > 0:
            k = k if k <= free else 1
            group_sizes.append(k)
            group_mbs.append([])
            free -= k
        if self.balance:
            self._steal(group_sizes, group_mbs)
        makespan = max((sum(c.time for c in g) for g in group_mbs), default=0.0)
        return Groups(group_sizes, group_mbs, makespan)

    # -- 3b. move micro-batches off the slowest group ----------------------------------
    def _steal(self, sizes: list[int], mbs: list[list[Chunk]]) -> None:
        """Local search on the step's makespan: move a micro-batch (or half of one, split in
        two) off the slowest group to a group where it finishes earlier, re-laid-out at that
        group's SP degree, while that lowers the slowest group's load."""
        ctx = self.ctx
        loads = [sum(c.time for c in g) for g in mbs]
        for _ in range(4 * sum(len(g) for g in mbs) + 8):
            src = max(range(len(loads)), key=loads.__getitem__)
            top = loads[src] * (1 - MIN_GAIN)
            # a moved micro-batch takes the same time on every group of one size: only the
            # least-loaded group of each size is a candidate destination
            least: dict[int, int] = {}
            for g, k in enumerate(sizes):
                if g != src and (k not in least or loads[g] < loads[least[k]]):
                    least[k] = g
            dsts = sorted(least.values())
            best = None
            for j, (chunk, _, t) in enumerate(mbs[src]):
                moves = [(chunk, None)]
                if len(chunk) > 1:
                    moves.append((chunk[len(chunk) // 2 :], chunk[: len(chunk) // 2]))
                for moved, kept in moves:
                    keep = None
                    rest = loads[src] - t
                    if kept is not None:
                        fit = ctx.layout_for(tuple(ctx.sizes[i] for i in kept), sizes[src], self.mode)
                        if fit is None:
                            continue
                        keep = Chunk(kept, fit.layout, fit.time)
                        rest += fit.time
                    if rest >= top:
                        continue
                    sz = tuple(ctx.sizes[i] for i in moved)
                    for dst in dsts:
                        if loads[dst] >= top:
                            continue
                        # SP never scales better than linearly: skip groups that cannot finish earlier
                        if keep is None and loads[dst] + t * sizes[src] / sizes[dst] * 0.95 >= top:
                            continue
                        fit = ctx.layout_for(sz, sizes[dst], self.mode)
                        if fit is None:
                            continue
                        new_max = max(rest, loads[dst] + fit.time)
                        if new_max < top and (best is None or new_max < best.end):
                            best = Move(new_max, j, dst, keep, Chunk(moved, fit.layout, fit.time))
            if best is None:
                return
            _, j, dst, keep, move = best
            loads[src] -= mbs[src].pop(j).time
            if keep is not None:
                mbs[src].insert(j, keep)
                loads[src] += keep.time
            mbs[dst].append(move)
            loads[dst] += move.time
