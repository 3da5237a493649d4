"""`dcp`'s thresholds and per-run tables: planning classes, their largest samples, per-sample
weights; the pause of the cycle collector while a step is planned.

The classes are the context's buckets, or finer text length ranges."""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dcparallel.plan.context import PlanContext, mbs_candidates
from dcparallel.plan.types import REL_TOL, TIME_EPS

if TYPE_CHECKING:
    from dcparallel.plan.dcp_scale import ScalePlanner

#: worlds and steps small enough to also run the per-sample planner (`ScalePlanner.fine`)
FINE_MAX_WORLD = 64
FINE_MAX_SAMPLES = 1024

#: text steps with at most this many samples per GPU (and FEW_MAX_SAMPLES) are also planned
#: over `SUB_BINS` classes per bucket (length ranges of 2 ** (1 / SUB_BINS))
FEW_PER_GPU = 8.0
FEW_MAX_SAMPLES = 2048
SUB_BINS = 4
#: ... when the class-level plan is predicted more than this factor above the step's bound
FINER_GATE = 1.01

#: steps with at most this many samples per GPU (and PACK_MAX_SAMPLES) whose class-level plan
#: is predicted more than PACK_GATE x the class-level bound are also planned sample by sample
#: (`dcp_sample`). The packing is Python work per sample and per target: about 0.2 s for 900
#: samples and 2.5 s for 7,800 on the machine of benchmarks/plan-cpu-time_cpu_2026-12-01.md
PACK_PER_GPU = 8.0
PACK_MAX_SAMPLES = 4096
PACK_GATE = 1.05
#: ... or more than this factor, for steps with at most one sample per GPU (there the class
#: level, which lays every sample out as its bucket's largest, is least exact; its plan's score
#: opens the gate too) and for steps whose longest micro-batch takes at least PACK_TAIL of the
#: bound (a heavy tail: the packing's sub-groups fill a long sample's wide group after it)
PACK_GATE_ONE = 1.03
PACK_TAIL = 0.5
#: larger steps whose class-level plan is predicted more than PACK_GATE x the class-level bound
#: (a heavy tail of long samples: `dcp_sample`) are packed in micro-batches of each bucket's
#: preferred size, when there are at most this many of them
PACK_MAX_ITEMS = 8192

#: the search over a phase's smallest allowed SP degree stops when its best plan is within
#: AT_BOUND of the phase's bound, or after STALE_STOP wider minimums in a row did not help
AT_BOUND = 1.002
STALE_STOP = 2

#: the search first covers this many of the narrowest smallest allowed degrees of every part
#: at once; most parts stop there (STALE_STOP), the others search the rest when they get there
FIRST_DEGREES = 3

#: the search over makespan targets first tries this many of them, evenly spread, then the
#: ones between the last that does not fit and the first that does
SEARCH_COARSE = 32

#: a step whose one-phase class-level plan is predicted more than CAP_GATE x its bound is
#: searched again with its micro-batches also capped at these fractions of the makespan target
#: (`dcp_search.fits`' `fracs`). At 1 each bucket takes its longest micro-batches that finish
#: within the target T; with a few samples of each of many shapes (a realistic video mix at a
#: strong budget) most of those are longer than T / 2 and need a group each, where capped
#: lower they are shorter and share groups, at some cost in GPU-seconds
CAP_FRACTIONS = (1.0, 0.75)
CAP_GATE = 1.01

#: a class-level candidate is expanded only within this factor of the best one's prediction
EXPAND_WITHIN = 1.02

#: bounded per-planner caches (candidate rows per (bucket, count)); emptied when full
ROW_CACHE_LIMIT = 50_000


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
