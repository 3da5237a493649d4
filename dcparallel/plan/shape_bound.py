"""The shape bound: a step lower bound for video steps that counts whole micro-batches of
each latent shape (docs/design.md, "Lower bound and efficiency").

A video micro-batch stacks samples of one latent shape (`spec.batch_key`, as the collate
stacks them), so its m samples on k ranks take at least tau_k(m), the fastest fitting time of
m copies of that shape (`LowerBound.copies_time`; the per-rank bound's only assumption). The
simple bound prices every sample at its shape's best micro-batch of up to 2^16 copies: a shape
with 3 samples in the step is priced as if they filled such a micro-batch, which no plan can
form, and a shape whose best micro-batch takes longer than the step at a size no plan of that
makespan can use.

For a makespan T and a threshold e (0 <= e <= 1/2), u_e(x) = 1 above 1 - e, 0 below e, x
between (`dff`) is dual feasible: the micro-batches a rank runs take at most T in all,
so their u_e(d / T) sum to at most 1, and over the world sum over micro-batches of
k * u_e(d / T) <= world. Since d >= tau_k(m), d <= T and u_e is monotone, every shape c with
n_c samples in the step contributes at least

    W_c^e(T) = min over ways to split n_c into micro-batches (k_i, m_i), sum m_i = n_c,
               tau_{k_i}(m_i) <= T, of sum_i k_i * u_e(tau_{k_i}(m_i) / T),

a small exact-count knapsack per shape (dynamic programming over the sample count). T is
proven too short when, for some e, sum_c W_c^e(T) > world (e = 0: the GPU-seconds the shapes'
whole micro-batches need exceed world * T). Feasibility is monotone in T (a larger T allows
more options and lowers every u_e(tau / T)), so a bisection finds the largest T it proves
too short. A shape of more than `EXACT_SAMPLES` samples is priced fractionally at e = 0 (its
samples times the fewest GPU-seconds per sample of any copies: a lower bound of its W_c^0) and
as 0 for e > 0 (u_e >= 0): both valid, only less tight.

Valid for any plan whose video micro-batches hold one shape; no assumption on how samples
of different shapes would share a micro-batch (A1, A2 of `plan/bounds.py`) is needed.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np

from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import Step
from dcparallel.spec import Size

#: a shape of at most this many samples in the step is split exactly; more are priced fractionally
EXACT_SAMPLES = 256
#: the thresholds e of the dual feasible functions tried at every T (0: the GPU-seconds)
SHAPE_EPS = (0.0, 0.1, 0.2, 0.25, 0.3, 1 / 3, 0.4, 0.5)


class Pricer(Protocol):
    """What the shape bound reads of `plan.bounds.LowerBound` (which calls it)."""

    ctx: PlanContext
    world: int

    def sample(self, size: Size) -> tuple[float, float]: ...

    def copies_time(self, sizes: Sequence[Size], m: int, k: int) -> float: ...


def dff(x: np.ndarray, e: np.ndarray) -> np.ndarray:
    """u_e(x): 1 above 1 - e, 0 below e, x between (a dual feasible function for e <= 1/2)."""
    return np.where(x > 1 - e, 1.0, np.where(x < e, 0.0, x))


class ShapeOptions:
    """One step's shapes: `n` samples each, `tau[c, j, m - 1]` the time of m copies of shape c
    at degree `ks[j]` (inf where they do not fit or m > n_c) for the exactly split shapes, and
    `work` the fractional GPU-seconds of the others."""

    def __init__(self, lb: Pricer, step: Step):
        ctx = lb.ctx
        shapes: dict = {}
        for i in step.sample_ids:
            shapes.setdefault(ctx.bucket_of[i], []).append(ctx.sizes[i])
        self.ks = np.asarray(ctx.mix_sizes, dtype=float)
        small = [sizes for sizes in shapes.values() if len(sizes) <= EXACT_SAMPLES]
        self.n = np.array([len(s) for s in small], dtype=np.int64)
        width = int(self.n.max()) if len(small) else 0
        self.tau = np.full((len(small), len(self.ks), width), np.inf)
        for c, sizes in enumerate(small):
            uniq = set(sizes)
            for j, k in enumerate(ctx.mix_sizes):
                tops = {z: ctx.max_mbs(z, k, "pac", cap=len(sizes)) for z in uniq}
                for m in range(1, max(tops.values()) + 1):
                    self.tau[c, j, m - 1] = lb.copies_time([z for z in uniq if tops[z] >= m], m, k)
        # a shape of many samples: each at its fewest GPU-seconds over copies of its sizes
        self.work = sum(
            len(sizes) * min(lb.sample(z)[0] for z in set(sizes))
            for sizes in shapes.values()
            if len(sizes) > EXACT_SAMPLES
        )
        fastest = [self.tau[c, :, 0].min() for c in range(len(small))]
        fastest += [min(lb.sample(z)[1] for z in set(sizes)) for sizes in shapes.values() if len(sizes) > EXACT_SAMPLES]
        #: no schedule ends before the slowest shape's fastest single sample
        self.floor = float(max(fastest))


def least_counts(cost: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The least total cost of splitting each shape's n_c samples into micro-batches:
    `cost[c, e, m - 1]` the cost of one micro-batch of m samples (inf: not allowed) under
    threshold e; returns [c, e]. Exact: W(j) = min over m of W(j - m) + cost(m), W(0) = 0."""
    S, E, M = cost.shape
    N = int(n.max()) if S else 0
    W = np.full((S, E, N + 1), np.inf)
    W[:, :, 0] = 0.0
    for j in range(1, N + 1):
        w = min(j, M)
        W[:, :, j] = (W[:, :, j - w : j][:, :, ::-1] + cost[:, :, :w]).min(axis=2)
    return W[np.arange(S), :, n] if S else np.zeros((0, E))


def shape_feasible(opts: ShapeOptions, T: float, world: float) -> bool:
    """Whether T survives every threshold's count (False proves no schedule ends by T)."""
    if T < opts.floor:
        return False
    eps = np.asarray(SHAPE_EPS)
    x = opts.tau / T  # [c, j, m]
    usable = x <= 1 + 1e-12
    # [c, e, m]: the cheapest degree for each micro-batch size under each threshold
    u = dff(x[:, None, :, :], eps[None, :, None, None]) * opts.ks[None, None, :, None]
    cost = np.where(usable[:, None, :, :], u, np.inf).min(axis=2)
    need = least_counts(cost, opts.n).sum(axis=0)  # [e]
    need[0] += opts.work / T
    return bool((need <= world * (1 + 1e-9)).all())


def shape_bound(lb: Pricer, step: Step, floor: float = 0.0) -> float:
    """The shape compute bound of a video step, at least `floor` (a valid bound found
    otherwise): the largest T a bisection proves too short (`shape_feasible`)."""
    opts = ShapeOptions(lb, step)
    world = float(lb.world)
    lo = max(floor, opts.floor)
    if shape_feasible(opts, lo * (1 + 1e-9), world):
        return lo
    hi = lo * 2.0
    while not shape_feasible(opts, hi, world):
        lo, hi = hi, hi * 2.0
    return bisect_too_short(lambda T: shape_feasible(opts, T, world), lo, hi)


def bisect_too_short(feasible: Callable[[float], bool], lo: float, hi: float) -> float:
    """The largest step time T found too short by halving [lo, hi) until it is within 1e-7 of
    hi: ``lo`` is proven too short (or a bound given), ``hi`` is not (``feasible(hi)``)."""
    while hi - lo > 1e-7 * hi:
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo
