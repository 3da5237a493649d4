"""`bucket`: the baseline as Open-Sora trains — one SP degree and one recompute setting for
the whole run, a fixed micro-batch size per bucket, micro-batches dealt round-robin.

Per bucket the micro-batch size is the largest that fits memory, then trimmed toward the
median micro-batch time over buckets (as hand-tuned bucket configs do). The step's
micro-batches, in data order, are dealt round-robin to the data-parallel groups, so
their counts differ by at most one (static gradient accumulation).

`tuned_bucket` picks the SP degree and recompute setting that give this baseline its best
predicted throughput on the data at hand; `default_bucket` is Open-Sora's default, the
smallest SP degree at which the longest sample fits with full recomputation.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

import numpy as np

from dcparallel.plan.assemble import assemble, round_robin
from dcparallel.plan.context import PlanContext, RecomputeMode
from dcparallel.plan.static_floor import StaticFloor
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, MicroBatch, NoLayoutFits, Score, StepPlan, Tuned
from dcparallel.spec import STATIC_MODES, Layout, Recompute


class BucketPlanner:
    name = "bucket"

    def __init__(self, ctx: PlanContext, sp: int, mode: RecomputeMode):
        self.ctx, self.sp, self.mode = ctx, sp, mode
        self.recompute = Recompute.static(mode, ctx.model.num_layers)
        self.mbs: dict[tuple[int, int], int] = {}
        times = {}
        for b, size in ctx.rep.items():
            m = ctx.max_mbs(size, sp, mode)
            if m == 0:
                raise NoLayoutFits(f"bucket {b} (size {size!r}) does not fit at sp={sp}, recompute={mode}")
            self.mbs[b] = m
            times[b] = ctx.copies_layout(size, m, sp, mode).time
        median = statistics.median(times.values())
        # trim toward the median micro-batch time: a bucket above it takes the most copies
        # below its own whose time is within it (else one), its times of 1 .. m - 1 copies
        # priced at once (`copies_times`: each `copies_layout`'s time)
        over = [b for b, t in times.items() if t > median and self.mbs[b] > 1]
        grids = ctx.copies_times([ctx.rep[b] for b in over], [self.mbs[b] - 1 for b in over], sp, mode) if over else []
        for b, ts in zip(over, grids):
            within = np.flatnonzero(ts <= median)
            self.mbs[b] = int(within[-1]) + 1 if len(within) else 1
        self.groups = ctx.topology.data_parallel(sp)
        #: no plan of a step by this planner is predicted below `floor(step)` (video)
        self.floor = StaticFloor(ctx, sp, mode, len(self.groups), self.mbs.__getitem__)

    def describe(self) -> dict:
        return {"sp": self.sp, "recompute": self.mode}

    def plan(self, step: Step) -> StepPlan:
        ctx = self.ctx
        open_chunks: dict[tuple[int, int], list[int]] = {}
        done: list[list[int]] = []
        for i in step.sample_ids:
            b = ctx.bucket_of[i]
            chunk = open_chunks.setdefault(b, [])
            chunk.append(i)
            if len(chunk) == self.mbs[b]:
                done.append(chunk)
                del open_chunks[b]
        done.extend(open_chunks.values())
        pos = {i: n for n, i in enumerate(step.sample_ids)}
        done.sort(key=lambda c: pos[c[0]])
        mbs = [MicroBatch(tuple(chunk), Layout(self.sp, len(chunk), self.recompute)) for chunk in done]
        deal = round_robin(len(mbs), len(self.groups))
        return assemble(ctx, step, [GroupPlan(r, tuple(mbs[j] for j in d)) for r, d in zip(self.groups, deal)])


def tune_static(ctx: PlanContext, steps: Sequence[Step], make, score: Score, max_steps: int = 64) -> Tuned:
    """Builds `make(ctx, sp, mode)` for every static SP degree and recompute setting and
    returns the one whose plans of (an even subset of) `steps` have the least predicted time
    (`score`: a plan's predicted step seconds), with the time of every candidate tried."""

    def candidates():
        for sp in ctx.topology.static_sizes(ctx.sp_sizes):
            for mode in STATIC_MODES:
                try:
                    yield f"sp{sp}-{mode}", make(ctx, sp, mode)
                except NoLayoutFits:
                    continue

    got = best_tuned(candidates(), even_subset(steps, max_steps), score)
    if got is None:
        raise NoLayoutFits(
            "no single SP degree and recompute setting fits every sample; "
            "static baselines cannot run this data on this cluster"
        )
    return got


def best_tuned(candidates: Iterable[tuple[str, Any]], steps: Sequence[Step], score: Score) -> Tuned | None:
    """Of the (name, planner) candidates (`plan.policies.Planner`s), the first whose plans of
    `steps` have the least summed `score`, with every candidate's sum by name; None without
    candidates."""
    tried: dict[str, float] = {}
    best = None
    for name, planner in candidates:
        t = sum(score(planner.plan(s)) for s in steps)
        tried[name] = t
        if best is None or t < best[0]:
            best = (t, planner)
    return None if best is None else Tuned(best[1], tried)


def even_subset(steps: Sequence[Step], max_steps: int) -> list[Step]:
    """At most `max_steps` of `steps`, evenly spread (all of them if there are fewer)."""
    subset = list(steps)
    if len(subset) > max_steps:
        stride = len(subset) / max_steps
        subset = [subset[int(i * stride)] for i in range(max_steps)]
    return subset


def tuned_bucket(ctx: PlanContext, steps: Sequence[Step], score: Score) -> Tuned:
    return tune_static(ctx, steps, BucketPlanner, score)


def default_bucket(ctx: PlanContext) -> BucketPlanner:
    for sp in ctx.topology.static_sizes(ctx.sp_sizes):
        try:
            p = BucketPlanner(ctx, sp, "full")
        except NoLayoutFits:
            continue
        p.name = "bucket-default"
        return p
    raise NoLayoutFits("no SP degree fits every sample even with full recomputation")
