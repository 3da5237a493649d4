"""Replays step plans on a cost model: per-group busy time, step time, idle, memory.

A step's groups run their micro-batches back to back; a group of a later phase starts
when all its ranks are done with the phase before (its collectives wait for them); the
step ends when the last rank is done and all ranks have met for the gradient sync; with
``overlap`` (the runtime's default) only the part of the sync that the last backward of the
last rank to finish cannot hide counts (`cost.overlap`). Idle is the time a rank is not
running a micro-batch before the sync. A micro-batch whose peak
memory exceeds the usable memory makes the plan invalid (counted in `memory_violations`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from dcparallel.cost.overlap import exposed_sync, sync_buckets
from dcparallel.plan.context import PlanContext
from dcparallel.plan.types import StepPlan


@dataclass(frozen=True, slots=True)
class Segment:
    """One micro-batch on one group, relative to the step's start (seconds)."""

    start: float
    end: float
    sp: int
    num_samples: int
    recompute: bool = False


@dataclass
class StepResult:
    index: int
    compute_time: float  # the last rank done
    sync_time: float
    group_ranks: list[tuple[int, ...]]
    group_busy: list[float]
    group_segments: list[list[Segment]]
    idle_gpu_s: float
    peak_memory: float
    num_tokens: int
    memory_violations: int

    @property
    def step_time(self) -> float:
        return self.compute_time + self.sync_time


@dataclass
class SimResult:
    world_size: int
    memory_bytes: float
    steps: list[StepResult] = field(default_factory=list)

    @property
    def total_time(self) -> float:
        return sum(s.step_time for s in self.steps)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        t = self.total_time
        return self.num_tokens / t if t > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        t = self.total_time
        return sum(s.idle_gpu_s for s in self.steps) / (self.world_size * t) if t > 0 else 0.0

    @property
    def step_time_median(self) -> float:
        return statistics.median(s.step_time for s in self.steps) if self.steps else 0.0

    @property
    def peak_memory_fraction(self) -> float:
        return max((s.peak_memory for s in self.steps), default=0.0) / self.memory_bytes

    @property
    def memory_violations(self) -> int:
        return sum(s.memory_violations for s in self.steps)

    def rank_timeline(self, rank: int) -> list[tuple[float, float, str]]:
        """(start, end, kind) spans of one rank over the run: kind "idle", "sync", or
        "busy sp=K" with " recompute" when the micro-batch recomputes anything."""
        out, t0 = [], 0.0
        for s in self.steps:
            t = 0.0
            for ranks, segs in zip(s.group_ranks, s.group_segments):
                if rank not in ranks:
                    continue
                for seg in segs:
                    if seg.start > t:
                        out.append((t0 + t, t0 + seg.start, "idle"))
                    out.append(
                        (t0 + seg.start, t0 + seg.end, f"busy sp={seg.sp}" + (" recompute" if seg.recompute else ""))
                    )
                    t = seg.end
            if s.compute_time > t:
                out.append((t0 + t, t0 + s.compute_time, "idle"))
            if s.sync_time > 0:
                out.append((t0 + s.compute_time, t0 + s.step_time, "sync"))
            t0 += s.step_time
        return out


def replay_step(plan: StepPlan, ctx: PlanContext, overlap: bool = True) -> StepResult:
    ranks, busy, segs = [], [], []
    peak, violations = 0.0, 0
    clock = [0.0] * ctx.cluster.world_size  # when each rank is done with its groups so far
    times, memory = ctx.mb_costs([mb for g in plan.groups for mb in g.micro_batches])
    costs = zip(times, memory)
    for g in plan.groups:  # in phase order
        t = start = max(clock[r] for r in g.ranks) if g.micro_batches else 0.0
        gsegs = []
        for mb in g.micro_batches:
            dt, mem = next(costs)
            peak = max(peak, mem)
            if mem > ctx.budget * (1 + 1e-9):
                violations += 1
            rc = mb.layout.recompute
            gsegs.append(Segment(t, t + dt, g.sp, len(mb.sample_ids), rc.attn + rc.mlp > 0))
            t += dt
        if g.micro_batches:
            for r in g.ranks:
                clock[r] = t
        ranks.append(g.ranks)
        busy.append(t - start)
        segs.append(gsegs)
    compute = max(clock, default=0.0)
    idle = compute * len(clock) - sum(b * len(r) for r, b in zip(ranks, busy))
    sync = _step_sync(ctx, compute, [(gs[-1].end, gs[-1].end - gs[-1].start) for gs in segs if gs], overlap)
    return StepResult(plan.index, compute, sync, ranks, busy, segs, idle, peak, plan.num_tokens, violations)


@dataclass(frozen=True)
class StepPrediction:
    """The simulator's replay of one whole step plan, as a loader hands it to the training loop."""

    compute_s: float
    """when the last rank is done with its micro-batches"""
    step_s: float
    """``compute_s`` plus the part of the gradient sync the last backward cannot hide"""
    peak_memory_bytes: float
    """the peak memory of the step's largest micro-batch"""


def predict_step(plan: StepPlan, ctx: PlanContext) -> StepPrediction:
    """`replay_step` of ``plan`` on ``ctx``, reduced to its `StepPrediction`."""
    r = replay_step(plan, ctx)
    return StepPrediction(r.compute_time, r.step_time, r.peak_memory)


class StepSeconds:
    """The simulator's score of a plan (`plan.types.Score`): its predicted step seconds
    (`step_time`). `priced(plan, times)` is the same score of a plan whose micro-batches'
    times on `ctx` (`PlanContext.mb_costs`' times, in the plan's order) its planner already
    holds: the planner need not price them again (`plan.types.PricedScore`)."""

    def __init__(self, ctx: PlanContext, overlap: bool = True):
        self.ctx, self.overlap = ctx, overlap

    def __call__(self, plan: StepPlan) -> float:
        return step_time(plan, self.ctx, self.overlap)

    def priced(self, plan: StepPlan, times: Sequence[float]) -> float:
        return step_time(plan, self.ctx, self.overlap, times)


def step_seconds(ctx: PlanContext, overlap: bool = True) -> StepSeconds:
    """The simulator's score of a plan (`plan.types.Score`): its predicted step seconds."""
    return StepSeconds(ctx, overlap)


def step_time(plan: StepPlan, ctx: PlanContext, overlap: bool = True, times: Sequence[float] | None = None) -> float:
    """`replay_step(plan, ctx, overlap).step_time` without the replay's segments, busy times
    and memory (planners score several plans per step): the same float operations in the same
    order, so the same value to the bit. `times`: the micro-batches' times (`mb_costs`'), in
    the plan's order, where the caller holds them."""
    clock = [0.0] * ctx.cluster.world_size
    if times is None:
        times = ctx.mb_costs([mb for g in plan.groups for mb in g.micro_batches], memory=False)[0]
    times = iter(times)
    ends: list[tuple[float, float]] = []  # per group with micro-batches: its end, its last one's time
    for g in plan.groups:  # in phase order
        if not g.micro_batches:
            continue
        t = max(clock[r] for r in g.ranks)
        for _ in g.micro_batches:
            start, t = t, t + next(times)
        for r in g.ranks:
            clock[r] = t
        ends.append((t, t - start))
    compute = max(clock, default=0.0)
    return compute + _step_sync(ctx, compute, ends, overlap)


def _step_sync(ctx: PlanContext, compute: float, ends: list[tuple[float, float]], overlap: bool) -> float:
    """The gradient sync a step leaves exposed: all of it without ``overlap``; else what the
    groups that finish last (``ends``: per group with micro-batches, its end and its last
    micro-batch's time) cannot hide, the shortest last micro-batch among them hiding the least."""
    sync = ctx.cost.grad_sync_time()
    if not overlap:
        return sync
    last = [dt for end, dt in ends if end >= compute * (1 - 1e-12)]
    return exposed_sync(
        sync,
        min(last, default=0.0),
        sync_buckets(ctx.cost.model.trainable_params, ctx.cluster.shard_size, ctx.cluster.world_size),
    )


def simulate(plans: Iterable[StepPlan], ctx: PlanContext, overlap: bool = True) -> SimResult:
    res = SimResult(ctx.cluster.world_size, ctx.budget)
    for p in plans:
        p.check_samples()  # a plan that lost or repeated a sample is refused, not timed
        res.steps.append(replay_step(p, ctx, overlap))
    return res
