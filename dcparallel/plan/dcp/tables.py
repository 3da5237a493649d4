"""`dcp`'s per-run tables: planning classes, their largest samples, per-sample weights;
bounded caches; the pause of the cycle collector while a step is planned.

The classes are the context's buckets, or finer text length ranges."""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dcparallel.plan.context import PlanContext, mbs_candidates
from dcparallel.plan.dcp.config import ROW_CACHE_LIMIT
from dcparallel.plan.types import REL_TOL, TIME_EPS

if TYPE_CHECKING:
    from dcparallel.plan.dcp.portfolio import ScalePlanner

def memo(cache: dict, key, make: Callable[[], Any], limit: int = ROW_CACHE_LIMIT):
    """`cache[key]`, made by `make()` on a miss; a full cache is emptied first (bounded memory,
    and a planner's results do not depend on what it has cached)."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) >= limit:
            cache.clear()
        hit = cache[key] = make()
    return hit


class Once:
    """A function of no arguments returning `make()`, computed on its first call only
    (`value`, if given, is that result already)."""

    def __init__(self, make: Callable[[], Any], value: Any = None):
        self.make, self.value = make, value

    def __call__(self) -> Any:
        if self.value is None:
            self.value = self.make()
        return self.value


def planning_classes(ctx: PlanContext, sub_bins: int) -> tuple[dict, list, np.ndarray]:
    """(largest sample size per class, the classes in order, each sample's class index; -1 for
    skipped samples). `sub_bins` == 1: the context's buckets; more: each bucket cut into length
    ranges 2 ** (1 / sub_bins) apart (text)."""
    if sub_bins == 1:
        key = {i: ctx.bucket_of[i] for i in ctx.usable_ids}
        rep = dict(ctx.rep)
    else:
        key = {i: (ctx.bucket_of[i], int(math.log2(max(1, ctx.tokens[i])) * sub_bins)) for i in ctx.usable_ids}
        big: dict = {}
        for i, c in key.items():
            if c not in big or ctx.tokens[i] > ctx.tokens[big[c]]:
                big[c] = i
        rep = {c: ctx.sizes[i] for c, i in big.items()}
    classes = sorted(rep)
    pos = {b: j for j, b in enumerate(classes)}
    bidx = np.full(len(ctx.sizes), -1, dtype=np.int64)
    for i, c in key.items():
        bidx[i] = pos[c]
    return rep, classes, bidx


def _cheapest_bucket(p: ScalePlanner, b) -> tuple[int, int]:
    opts = p.ctx.bucket_options(b, p.mode)
    k = min(opts, key=lambda k: (opts[k].gpu_s_per_sample, k))
    return k, opts[k].layout.mbs


def _cheapest(p: ScalePlanner, j: int) -> tuple[int, int]:
    """(SP degree, micro-batch size) of least GPU-seconds per sample for class j."""
    best = None
    for k in p.sp:
        for m in mbs_candidates(p.top[(j, k)]) if p.top[(j, k)] else ():
            g = p._lt(j, m, k)[1] * k / m
            if best is None or g < best[0] * (1 - REL_TOL):
                best = (g, k, m)
    return best[1], best[2]


def sample_weights(p: ScalePlanner) -> np.ndarray:
    """Per sample, its micro-batch time relative to its class's largest sample: a class's
    times are planned for copies of its largest sample and scaled by the mean weight of the
    samples a step holds (a text bucket spans 1.25x in length, more in attention work).
    Linear in tokens between the class's smallest and largest sample, both timed by the
    cost model as a full micro-batch of the class's preferred layout (convex times make
    this slightly pessimistic, never optimistic)."""
    ctx = p.ctx
    tok = p.tok.astype(float)
    w = np.ones(len(ctx.sizes))
    small: dict[int, int] = {}
    for i in ctx.usable_ids:
        j = int(p.bidx[i])
        if j not in small or ctx.tokens[i] < ctx.tokens[small[j]]:
            small[j] = i
    lo = np.zeros(len(p.buckets))
    t_lo = np.ones(len(p.buckets))
    hi = np.ones(len(p.buckets))
    for j, b in enumerate(p.buckets):
        big_s, small_s = p.rep[b], ctx.sizes[small[j]]
        k, m = _cheapest(p, j) if p.sub_bins > 1 else _cheapest_bucket(p, b)
        tb = ctx.cost.terms_copies(big_s, m, k).time_none
        ts = ctx.cost.terms_copies(small_s, m, k).time_none
        lo[j], hi[j] = ctx.model.tokens(small_s), ctx.model.tokens(big_s)
        t_lo[j] = min(1.0, ts / tb) if tb > 0 else 1.0
    ids = np.asarray(ctx.usable_ids, dtype=np.int64)
    j = p.bidx[ids]
    span = np.maximum(hi[j] - lo[j], TIME_EPS)
    u = np.clip((tok[ids] - lo[j]) / span, 0.0, 1.0)
    w[ids] = np.where(hi[j] > lo[j], t_lo[j] + (1.0 - t_lo[j]) * u, 1.0)
    return w


@contextmanager
def cyclic_gc_paused():
    """Python's cycle collector paused while a step is planned. A plan at thousands of GPUs
    allocates a few hundred thousand small objects (micro-batches, their id tuples), which
    sets off collections that walk the whole heap — the workload, the model, the loader —
    and measured up to half of a step's planning time at 4096 GPUs. Planning makes no
    reference cycles (reference counting frees all it drops), so nothing piles up meanwhile;
    the collector resumes, in every thread, when the step is planned."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
