"""What every planner shares once it has chosen its groups: dealing micro-batches to groups
(`lpt`, `round_robin`) and assembling the `StepPlan` (`assemble`), with a one-rank idle group
for every rank that no group of a phase covers."""

from __future__ import annotations

import heapq
from typing import Iterable, Sequence

import numpy as np

from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, GroupSource, StepPlan


def lpt(times: Sequence[float], num_bins: int, *, dealt_order: bool = False) -> tuple[list[list[int]], list[float]]:
    """Longest-processing-time-first: items, longest first (ties: the earlier item), each to
    the least-loaded bin (ties: the lower bin). Returns the item indices per bin, ascending
    (`dealt_order`: in the order dealt), and the bins' loads, each summed in the order dealt."""
    heap = [(0.0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(times)), key=lambda j: -times[j]):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + times[i], b))
    loads = [0.0] * num_bins
    for load, b in heap:
        loads[b] = load
    if not dealt_order:
        for b in bins:
            b.sort()
    return bins, loads


def round_robin(num_items: int, num_bins: int) -> list[list[int]]:
    """Items dealt in order to bins 0, 1, ..., num_bins - 1, 0, 1, ...: counts differ by at most one."""
    return [list(range(b, num_items, num_bins)) for b in range(num_bins)]


def idle_ranks(world: int, blocks: Sequence[Sequence[int]]) -> list[int]:
    """The ranks of a world that none of one phase's (disjoint) blocks covers, ascending."""
    covered = sum(len(b) for b in blocks)
    if max((b[-1] for b in blocks if b), default=-1) + 1 == covered:  # no gaps: ranks 0 .. covered - 1
        return list(range(covered, world))
    used = [False] * world
    for b in blocks:
        for r in b:
            used[r] = True
    return [r for r in range(world) if not used[r]]


def with_idle(groups: Iterable[GroupPlan], world: int, *, by_rank: bool = False) -> tuple[GroupPlan, ...]:
    """A step's groups in phase order, each phase's as given followed by a one-rank group, with
    no micro-batches, for every rank no group of that phase covers (ascending). `by_rank`: each
    phase's groups, idle ones among them, by first rank (for planners whose groups nest)."""
    phases: dict[int, list[GroupPlan]] = {}
    for g in groups:
        phases.setdefault(g.phase, []).append(g)
    out: list[GroupPlan] = []
    for phase in range(1 + max(phases, default=0)):
        mine = phases.get(phase, [])
        mine = mine + [GroupPlan((r,), (), phase) for r in idle_ranks(world, [g.ranks for g in mine])]
        out.extend(sorted(mine, key=lambda g: g.ranks[0]) if by_rank else mine)
    return tuple(out)


def assemble(
    ctx: PlanContext,
    step: Step,
    groups: Iterable[GroupPlan] | GroupSource,
    *,
    by_rank: bool = False,
    ids: np.ndarray | None = None,
) -> StepPlan:
    """The `StepPlan` of a step's groups (`with_idle` adds the idle ones; a `GroupSource` adds
    its own, with `with_idle`, when built) and its token count (`PlanContext.step_tokens`;
    `ids`: the step's sample ids as an array, in any order, where the planner holds them)."""
    if not hasattr(groups, "of_rank"):
        groups = with_idle(groups, ctx.cluster.world_size, by_rank=by_rank)
    return StepPlan(step.index, step.sample_ids, groups, ctx.step_tokens(step.sample_ids if ids is None else ids))


def regroup(plan: StepPlan, groups: Iterable[GroupPlan]) -> StepPlan:
    """``plan`` with its groups replaced by ``groups`` of the same ranks, samples and phases
    (e.g. their micro-batches' layouts changed): the step's samples and tokens stay."""
    return StepPlan(plan.index, plan.sample_ids, tuple(groups), plan.num_tokens)
