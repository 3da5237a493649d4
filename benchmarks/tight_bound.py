"""A tighter step lower bound than `plan.bounds.LowerBound`, for the scale report: it shows
where the official bound is loose (few samples per GPU), without replacing it.

The official bound is max(sum_s g(s) / world, max_s f(s)): g(s) is the fewest GPU-seconds
any layout spends on s and f(s) the fastest any layout finishes it, but the two may come
from different SP degrees (g from a narrow group, f from the widest). A step that finishes
by T cannot run s at an SP degree k where s alone takes longer than T, so

    bound_T(step) = min T such that T >= max_s f(s) and sum_s g_T(s) <= world * T,
    g_T(s) = min over degrees k with f_k(s) <= T of g_k(s),

with f_k(s) the fastest time of s alone at degree k and g_k(s) the fewest GPU-seconds per
sample of micro-batches of copies of s at k (the official bound's g is min_k g_k). Under
the official bound's own assumptions it is valid, and never below it. Plus the same exposed
gradient sync.
"""

from __future__ import annotations

import numpy as np

from dcparallel.plan.context import PlanContext, mbs_candidates
from dcparallel.plan.steps import Step
from dcparallel.sim.overlap import exposed_sync, num_buckets


class TightBound:
    def __init__(self, ctx: PlanContext):
        self.ctx = ctx
        self._fg: dict = {}

    def sample(self, size) -> tuple[np.ndarray, np.ndarray]:
        """(f_k, g_k) over the context's SP degrees (inf where s does not fit)."""
        hit = self._fg.get(size)
        if hit is not None:
            return hit
        ctx = self.ctx
        f = np.full(len(ctx.sp_sizes), np.inf)
        g = np.full(len(ctx.sp_sizes), np.inf)
        for j, k in enumerate(ctx.sp_sizes):
            top = ctx.max_mbs(size, k, "pac")
            if top == 0:
                continue
            f[j] = ctx.copies_layout(size, 1, k, "pac")[1]
            g[j] = min(ctx.copies_layout(size, m, k, "pac")[1] * k / m for m in mbs_candidates(top))
        self._fg[size] = (f, g)
        return f, g

    def compute(self, step: Step) -> float:
        """The compute part of the bound (no sync)."""
        ctx = self.ctx
        sizes = [ctx.sizes[i] for i in step.sample_ids]
        uniq: dict = {}
        for s in sizes:
            uniq[s] = uniq.get(s, 0) + 1
        fs = np.array([self.sample(s)[0] for s in uniq])
        gs = np.array([self.sample(s)[1] for s in uniq])
        cnt = np.array(list(uniq.values()), dtype=float)
        world = ctx.cluster.world_size
        fmax = float(fs.min(axis=1).max())
        cands = np.unique(fs[np.isfinite(fs)])
        cands = np.concatenate([[fmax], cands[cands > fmax]])
        best = np.inf
        for T in cands:  # the work needed is constant between breakpoints and falls as T grows
            work = float((np.where(fs <= T * (1 + 1e-12), gs, np.inf).min(axis=1) * cnt).sum())
            got = max(T, work / world)
            best = min(best, got)
            if work / world <= T:
                break
        return best

    def step(self, step: Step) -> float:
        ctx = self.ctx
        compute = self.compute(step)
        return compute + exposed_sync(ctx.cost.grad_sync_time(), compute, num_buckets(ctx.cost.model.num_params))
