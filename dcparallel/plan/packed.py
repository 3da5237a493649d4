"""`packed`: the packing baseline — one SP degree and recompute setting for the run; the
step's samples are packed into token-capacity bins (first-fit decreasing), each bin one
micro-batch (text: documents packed into one row with `cu_seqlens`; video: same-shape
samples stacked, so bins are filled within each latent shape, `spec.batch_key`), and the
bins dealt evenly to the data-parallel groups (longest bin first to the least-loaded group).
The capacity is the most tokens a micro-batch can hold in memory at that SP degree and
recompute setting.

`tuned_packed` picks the SP degree and recompute setting with the best predicted
throughput, as `tuned_bucket` does.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

from dcparallel.plan.assemble import assemble, lpt
from dcparallel.plan.binpack import pack_bins
from dcparallel.plan.bucket import tune_static
from dcparallel.plan.context import PlanContext, RecomputeMode
from dcparallel.plan.static_floor import StaticFloor
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, MicroBatch, NoLayoutFits, Score, StepPlan, Tuned
from dcparallel.spec import Layout, Recompute


class PackedPlanner:
    name = "packed"

    def __init__(self, ctx: PlanContext, sp: int, mode: RecomputeMode):
        self.ctx, self.sp, self.mode = ctx, sp, mode
        self.recompute = Recompute.static(mode, ctx.model.num_layers)
        self.capacity = self._capacity()
        self.groups = ctx.topology.data_parallel(sp)
        #: no plan of a step by this planner is predicted below `floor(step)` (video)
        self.floor = StaticFloor(ctx, sp, mode, len(self.groups), partial(_most, ctx, self.capacity, sp, mode))

    def _capacity(self) -> int:
        """Tokens a bin may hold. Text: the longest single document that fits (packed
        documents cost the memory of their total length). Video: the most tokens any
        bucket's samples fill when stacked; bins are checked against memory afterwards."""
        ctx = self.ctx
        text = ctx.model.kind == "text"
        caps = []
        for size in ctx.rep.values():
            if text:  # only whether it fits alone: the capacity is sized on single documents below
                m = 0 if ctx.copies_layout(size, 1, self.sp, self.mode) is None else 1
            else:
                m = ctx.max_mbs(size, self.sp, self.mode, cap=1 << 16)
            if m == 0:
                raise NoLayoutFits(f"size {size!r} does not fit at sp={self.sp}, recompute={self.mode}")
            caps.append(m * ctx.model.tokens(size))
        if not text:
            return max(caps)
        lo = max(ctx.tokens[i] for i in ctx.usable_ids)  # fits: every rep fitted above
        hi = lo
        while ctx.copies_layout(hi * 2, 1, self.sp, self.mode) is not None and hi < 1 << 26:
            lo = hi = hi * 2
        hi *= 2
        while hi - lo > max(1, lo // 256):
            mid = (lo + hi) // 2
            if ctx.copies_layout(mid, 1, self.sp, self.mode) is not None:
                lo = mid
            else:
                hi = mid
        return lo

    def describe(self) -> dict:
        return {"sp": self.sp, "recompute": self.mode, "capacity_tokens": self.capacity}

    def _bins(self, ids: Sequence[int]) -> list[list[int]]:
        return pack_bins(self.ctx, ids, self.capacity, self.sp, self.mode)

    def plan(self, step: Step) -> StepPlan:
        ctx = self.ctx
        bins = self._bins(step.sample_ids)
        mbs = [MicroBatch(tuple(b), Layout(self.sp, len(b), self.recompute)) for b in bins]
        # each bin's time at this recompute: what `pack_bins` found when it checked the bin's memory
        sizes = ctx.sizes
        times = [ctx.layout_for(tuple(sizes[i] for i in b), self.sp, self.mode).time for b in bins]
        assign, _ = lpt(times, len(self.groups))
        return assemble(ctx, step, [GroupPlan(r, tuple(mbs[j] for j in assign[g])) for g, r in enumerate(self.groups)])


def _most(ctx: PlanContext, capacity: int, sp: int, mode: RecomputeMode, b: tuple) -> int:
    """The most copies of video class b a bin of `capacity` tokens holds: what the capacity
    takes (at least one), cut where memory ends. (A function, not a method: the floor holding
    a bound method would be a reference cycle, and planning makes none.)"""
    size = ctx.rep[b]
    take = max(1, capacity // ctx.model.tokens(size))
    return min(take, ctx.max_mbs(size, sp, mode, cap=take))


def tuned_packed(ctx: PlanContext, steps: Sequence[Step], score: Score) -> Tuned:
    return tune_static(ctx, steps, PackedPlanner, score)
