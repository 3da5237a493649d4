"""Each micro-batch's (Ulysses, ring) split, set in the plan where the cluster allows ring.

With `ClusterSpec.ring` the topology offers SP sizes past the head count and the cost model
prices a micro-batch at a size by its best split (`cost.ring.least_comm`). The planners
choose sizes by those prices and build layouts with ring degree 1; `SplitPlanner` then sets
each micro-batch's `Layout.ring` to the split its price was for (`cost.ring.best_split`, the
same choice), so the plan runs what was priced. Without ring nothing is touched: plans stay
as the planners made them.

A `ProfiledCost` names, among the splits each size was measured at
(`Topology.profiled_splits`), the one measured fastest for the micro-batch, so a profiled
plan runs what was timed. A cost model without `best_split` keeps ring degree 1.
"""

from __future__ import annotations

from dcparallel.plan.assemble import regroup
from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan, micro_batches
from dcparallel.spec import Layout


def split_layout(ctx: PlanContext, mb: MicroBatch) -> Layout:
    """``mb``'s layout at the ring degree of the split its cost is priced at (ring 1 on one
    rank, or where the cost model prices no split)."""
    lay = mb.layout
    best_split = getattr(ctx.cost, "best_split", None)
    if lay.sp == 1 or best_split is None:
        return lay
    ring = best_split(tuple(ctx.sizes[i] for i in mb.sample_ids), lay.sp).ring
    return lay if ring == lay.ring else Layout(lay.sp, lay.mbs, lay.recompute, ring)


def with_splits(ctx: PlanContext, plan: StepPlan) -> StepPlan:
    """``plan`` with every micro-batch at its priced split (`split_layout`)."""
    groups = tuple(
        GroupPlan(g.ranks, tuple(micro_batches((m.sample_ids, split_layout(ctx, m)) for m in g.micro_batches)), g.phase)
        for g in plan.groups
    )
    return regroup(plan, groups)


class SplitPlanner:
    """A planner whose plans get their splits (`with_splits`): what `plan.policies.tune`
    hands out where the cluster allows ring."""

    def __init__(self, inner, ctx: PlanContext):
        self.inner, self.ctx = inner, ctx
        self.name = inner.name

    def plan(self, step: Step) -> StepPlan:
        return with_splits(self.ctx, self.inner.plan(step))

    def describe(self) -> dict:
        return {**self.inner.describe(), "splits": "Ulysses x ring per micro-batch, the fastest priced"}

    def __getattr__(self, name: str):  # the inner planner's own attributes (settings, counters)
        return getattr(self.inner, name)
