"""The lower bound of a step and the epoch efficiency of a policy (docs/design.md, "Lower bound and efficiency").

bound(step) = max(sum_s g(s) / world, max_s f(s)) + exposed gradient sync, where
g(s) = the fewest GPU-seconds any memory-feasible layout spends on s (time * sp / mbs over
the allowed group sizes, micro-batch sizes and recompute settings, the micro-batch made of
copies of s) and f(s) = the fastest time any feasible layout finishes s.

"Any layout" is the layout space the planners search: the SP degrees of `sp_chain`,
micro-batch sizes 1, 2, 4, ... and the largest that fits (up to 64), and every recompute
split (the PAC knapsack gives the fastest one that fits).

Exposed sync: the runtime overlaps the bucketed sync with each rank's last backward, which
is no longer than the backward share of the step's compute, and the last bucket is always
exposed: max(sync - BACKWARD_FRACTION * compute bound, sync / buckets) (`cost.overlap`).
"""

from __future__ import annotations

from typing import Sequence

from dcparallel.cost.overlap import exposed_sync, num_buckets
from dcparallel.plan.context import PlanContext, mbs_candidates
from dcparallel.plan.steps import Step
from dcparallel.spec import Size


class LowerBound:
    def __init__(self, ctx: PlanContext):
        self.ctx = ctx
        self._gf: dict[Size, tuple[float, float]] = {}

    def sample(self, size: Size) -> tuple[float, float]:
        """(g, f) of one sample size."""
        hit = self._gf.get(size)
        if hit is not None:
            return hit
        ctx = self.ctx
        g = f = float("inf")
        for k in ctx.sp_sizes:
            top = ctx.max_mbs(size, k, "pac")
            if top == 0:
                continue
            f = min(f, ctx.copies_layout(size, 1, k, "pac").time)
            for mbs in mbs_candidates(top):
                _, t = ctx.copies_layout(size, mbs, k, "pac")
                g = min(g, t * k / mbs)
        assert f < float("inf"), f"size {size!r} fits no layout"
        self._gf[size] = (g, f)
        return g, f

    def step(self, step: Step) -> float:
        ctx = self.ctx
        gs, fmax = 0.0, 0.0
        for i in step.sample_ids:
            g, f = self.sample(ctx.sizes[i])
            gs += g
            fmax = max(fmax, f)
        compute = max(gs / ctx.cluster.world_size, fmax)
        return compute + exposed_sync(ctx.cost.grad_sync_time(), compute, num_buckets(ctx.cost.model.num_params))

    def epoch(self, steps: Sequence[Step]) -> float:
        return sum(self.step(s) for s in steps)

