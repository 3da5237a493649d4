"""`token-budget`: the dynamic batch size of RL frameworks, reproduced from its description
(verl's ``use_dynamic_bsz`` with ``balance_batch``; OpenRLHF and NeMo-RL pack alike).

One SP degree for the run — the smallest that holds the longest sample — with gradient
checkpointing on (full recompute), as those frameworks configure a long-reasoning run. Per
step:

1. the samples are dealt to the data-parallel groups in equal counts (ceil / floor),
   longest first, each to the group with the fewest tokens that still has room;
2. each group's samples are cut into micro-batches of at most a token budget (the most
   tokens a packed micro-batch holds in memory at that degree), longest first to the
   lightest micro-batch;
3. every group runs the same number of micro-batches (the largest any group needs, the
   collective-count rule that keeps FSDP ranks in step), so a group with few tokens splits
   them finer.

Video samples (not what RL frameworks train) are packed per shape instead (`pack_bins`: same-shape
samples stack), with no equal-count rule.
"""

from __future__ import annotations

import math
from typing import Sequence

from dcparallel.plan.assemble import assemble, lpt
from dcparallel.plan.binpack import pack_bins
from dcparallel.plan.context import PlanContext
from dcparallel.plan.packed import PackedPlanner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, MicroBatch, NoLayoutFits, Score, StepPlan, Tuned
from dcparallel.spec import Layout, Recompute


def _equal_count_deal(ids: Sequence[int], tokens: Sequence[int], num_groups: int) -> list[list[int]]:
    """Step 1: equal counts, balanced tokens (greedy, longest first)."""
    room = [len(ids) // num_groups + (g < len(ids) % num_groups) for g in range(num_groups)]
    load = [0] * num_groups
    out: list[list[int]] = [[] for _ in range(num_groups)]
    for i in sorted(ids, key=lambda j: (-tokens[j], j)):
        g = min((g for g in range(num_groups) if room[g]), key=lambda g: (load[g], g))
        out[g].append(i)
        load[g] += tokens[i]
        room[g] -= 1
    return out


class TokenBudgetPlanner:
    name = "token-budget"

    def __init__(self, ctx: PlanContext):
        self.ctx = ctx
        longest = max(ctx.sizes[i] for i in ctx.usable_ids)
        fits = [k for k in ctx.sp_sizes if ctx.max_mbs(longest, k, "full") > 0]
        if not fits:
            raise NoLayoutFits(
                f"the longest sample ({longest!r}) fits no SP degree of {ctx.sp_sizes} with full recompute"
            )
        self.sp = fits[0]
        self.recompute = Recompute.static("full", ctx.model.num_layers)
        self.budget = PackedPlanner(ctx, self.sp, "full").capacity  # tokens of one packed micro-batch
        self.groups = ctx.topology.data_parallel(self.sp)

    def describe(self) -> dict:
        return {"sp": self.sp, "recompute": "full", "token_budget": self.budget}

    def _micro_batches(self, ids: list[int], count: int) -> list[list[int]]:
        tokens = self.ctx.tokens
        bins, _ = lpt([tokens[i] for i in ids], count)
        return [[ids[j] for j in b] for b in bins if b]

    def plan(self, step: Step) -> StepPlan:
        ctx = self.ctx
        per_group = _equal_count_deal(step.sample_ids, ctx.tokens, len(self.groups))
        if ctx.model.kind != "text":
            cut = [pack_bins(ctx, ids, self.budget, self.sp, "full") for ids in per_group]
            return self._assemble(step, cut)
        count = max(math.ceil(sum(ctx.tokens[i] for i in ids) / self.budget) for ids in per_group)
        while True:  # the same micro-batch count everywhere; one more while a balanced cut overflows
            cut = [self._micro_batches(ids, count) for ids in per_group]
            if all(sum(ctx.tokens[i] for i in mb) <= self.budget or len(mb) == 1 for mbs in cut for mb in mbs):
                break
            count += 1
        return self._assemble(step, cut)

    def _assemble(self, step: Step, cut: list[list[list[int]]]) -> StepPlan:
        groups = [
            GroupPlan(r, tuple(MicroBatch(tuple(mb), Layout(self.sp, len(mb), self.recompute)) for mb in mbs))
            for r, mbs in zip(self.groups, cut)
        ]
        return assemble(self.ctx, step, groups)


def build_token_budget(ctx: PlanContext, steps: Sequence[Step], score: Score) -> Tuned:
    return Tuned(TokenBudgetPlanner(ctx))
