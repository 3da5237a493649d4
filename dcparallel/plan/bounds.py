"""The lower bound of a step and the epoch efficiency of a policy (docs/design.md, "Lower bound and efficiency").

The layout model: a micro-batch runs on a group of k ranks (an SP degree of the context) for
its whole time, and a rank runs one micro-batch at a time (as `sim.replay` does). The degrees
are every one a planner may use (`PlanContext.mix_sizes`). Per sample s
and degree k, f_k(s) is the time of s alone at k and g_k(s) the fewest GPU-seconds s adds to
a micro-batch at k: on video, whose micro-batches stack copies of one shape, those per sample
of micro-batches of copies of s (time * k / m over every size m that fits, with the
fastest recompute that fits: `PlanContext.fewest_gpu_seconds`); on text, whose micro-batches
mix lengths, what it adds to any micro-batch that fits (`plan.mix_share`). A micro-batch of
time d at degree k satisfies

    (A1) f_k(s) <= d for each of its samples (a sample does not run faster in company),
    (A2) the g_k of its samples sum to at most k * d.

The step's compute bound is the largest of four, each valid on its own:

- **simple**: max(sum_s g(s) / world, max_s f(s)), g = min_k g_k, f = min_k f_k (the two may
  come from different degrees: g from a narrow group, f from the widest).
- **midpoint** (every step; above the simple one with few samples per GPU): take any schedule
  that ends by T and look at the instant T / 2. Every micro-batch longer than T / 2 runs then,
  so their degrees sum to at most the world. A sample may use degree k only if f_k(s) <= T (A1);
  it is *long* at k if f_k(s) > T / 2, and then holds k / Q of the midpoint ranks, Q the most
  long samples its micro-batch can hold (by A2, their g_k fit in k * T). Relaxing each sample's
  degree to a convex mix gives an LP: T is feasible only if some mix has sum g <= world * T and
  midpoint ranks <= world. The LP is solved through its Lagrangian dual, V(T) = max over lambda
  >= 0 of sum_s min_k (g_k + lambda * r_k) - lambda * world (any lambda gives a value below V,
  so an early stop only lowers the bound), on the intervals between the breakpoints f_k and 2
  f_k.
- **per-rank** (video steps of few samples per GPU; needs neither A1 nor A2): a video
  micro-batch stacks samples of one latent shape (`spec.batch_key`: every policy plans so, as
  the collate stacks them), so its time is at least tau_k(m), the fastest
  fitting time of m copies of that shape at k. The micro-batches a rank runs fit in T; a dual
  feasible function u (u(x) + u(y) + ... <= 1 whenever x + y + ... <= 1) keeps that true of
  u(d / T), so over all ranks sum of k * u(d / T) <= world. With u_e(x) = 1 above 1 - e, 0
  below e, x between (0 <= e <= 1/2), split over each micro-batch's samples and relaxed to a mix
  of options (k, m), T is feasible only if one mix meets the inequality of every e tried: a
  feasibility LP (HiGHS through scipy). A T whose LP is infeasible is proven too short. The
  LP also holds the inequalities of the step functions u^(q)(x) = floor((q + 1) x (1 - 1e-9))
  / q (q = 1..`PER_RANK_STEPS`), dual feasible too (`step_dff`): micro-batches each over
  1 / (q + 1) of T count at least 1 / q each, so no rank holds more than q of them.
  They see what u_e does not when many micro-batches are just over a third or a quarter of
  T: strong 256-GPU video-mix steps 0.8-1.4% above the other bounds with u_e alone, 2.2-2.8%
  with both.
- **shape** (video, every step; `plan.shape_bound`): the same one-shape micro-batches counted
  whole: each shape's samples split exactly into micro-batches of tau <= T, per threshold e.

Why these: with about one sample per GPU or fewer, the simple bound's two terms come from
different degrees and no plan has both; the midpoint bound then limits the degrees by the
makespan and counts the ranks the long micro-batches hold at once (5-15% above the simple
bound at 512 GPUs and 0.2-0.8 samples per GPU); the per-rank bound sees that a rank running a
long micro-batch has no room for a medium one, however short that is against T / 2 (7% above
both at 128 GPUs and 0.3 samples per GPU, video). With many samples per GPU every sample is
short against the step and the simple bound is reached. The midpoint bound is computed on
every step (at most about 50 ms on the scale report's steps, thousands of distinct lengths
included; 3-6% above the simple bound on its strong 256-GPU text steps of 3-5.5 samples per
GPU, where the longest documents need wide groups for half the step); the per-rank bound only
on steps of at most `TIGHT_PER_GPU` samples per GPU (a HiGHS LP per makespan tried: 7-40 s
per step at 2.7-9 samples per GPU, for 0.6-1.8% more there). The shape bound prices what a shape
of few samples in the step can form (0.2-0.3% above the others on image-bucket steps of 9 samples
per GPU). Every bound is valid whether or not the others are computed.

Exposed sync, added to the compute bound: the runtime overlaps the bucketed sync with each
rank's last backward, which is no longer than the backward share of the step's compute, and
the last bucket is always exposed: max(sync - BACKWARD_FRACTION * compute, sync / buckets)
(`cost.overlap`). It grows with compute, so a larger compute bound gives a larger step bound.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from dcparallel.cost.overlap import exposed_sync, sync_buckets
from dcparallel.plan.context import PlanContext
from dcparallel.plan.mix_share import BOUND_MAX_COPIES, fewest_shares
from dcparallel.plan.shape_bound import bisect_too_short, dff, shape_bound
from dcparallel.plan.steps import Step
from dcparallel.spec import Size

#: the per-rank bound is computed for steps of at most this many samples per GPU
TIGHT_PER_GPU = 2.0
#: the per-rank bound's thresholds e tried at every T, besides the step's own
PER_RANK_EPS = (0.0, 0.1, 0.2, 0.25, 0.3, 1 / 3, 0.4, 0.5)
#: the per-rank bound's step functions u^(q), q = 1..this, in every LP (more moved no bound
#: of the scale report's strong 256-GPU video steps)
PER_RANK_STEPS = 6


class LowerBound:
    """The step and epoch bounds of one context. `per_rank_per_gpu`: the per-rank bound is
    computed on video steps of at most that many samples per GPU (`TIGHT_PER_GPU` by default,
    where it costs seconds; the scale report goes to 16, at up to about ten seconds per step)."""

    def __init__(self, ctx: PlanContext, per_rank_per_gpu: float = TIGHT_PER_GPU):
        self.ctx = ctx
        self.world = ctx.cluster.world_size
        self.per_rank_per_gpu = per_rank_per_gpu
        self._fg: dict[Size, tuple[np.ndarray, np.ndarray]] = {}
        self._gf: dict[Size, tuple[float, float]] = {}
        #: per size, g_k of a sample in any mix (`plan.mix_share`); video micro-batches are copies
        self._share: dict[Size, np.ndarray] = {}

    # -- per sample ----------------------------------------------------------------------
    def degrees(self, size: Size) -> tuple[np.ndarray, np.ndarray]:
        """(f_k, g_k) of one sample size over the context's SP degrees (inf where it does not fit)."""
        hit = self._fg.get(size)
        if hit is not None:
            return hit
        ctx = self.ctx
        video = ctx.model.kind == "video"
        f = np.full(len(ctx.mix_sizes), np.inf)
        g = np.full(len(ctx.mix_sizes), np.inf) if video else self.shares([size])[size]
        for j, k in enumerate(ctx.mix_sizes):
            one = ctx.copies_layout(size, 1, k, "pac")
            if one is None:
                continue
            f[j] = one.time
            if video:  # a micro-batch of copies: any number that fits, not only the planners' 64
                g[j] = ctx.fewest_gpu_seconds(size, k, ctx.max_mbs(size, k, "pac", cap=BOUND_MAX_COPIES))
        assert np.isfinite(f).any(), f"size {size!r} fits no layout"
        self._fg[size] = (f, g)
        return f, g

    def shares(self, sizes) -> dict[Size, np.ndarray]:
        """g_k of each size in any mix at every degree (`plan.mix_share`), priced at once for
        the sizes not cached yet (in chunks: a step's thousands of distinct lengths)."""
        todo = [s for s in dict.fromkeys(sizes) if s not in self._share]
        for lo in range(0, len(todo), 1024):
            part = todo[lo : lo + 1024]
            g = np.stack([fewest_shares(self.ctx, part, k) for k in self.ctx.mix_sizes], axis=1)
            self._share.update(zip(part, g))
        return self._share

    def sample(self, size: Size) -> tuple[float, float]:
        """(g, f) of one sample size: its fewest GPU-seconds and fastest time at any degree
        (cached: the simple bound asks once per sample of every step)."""
        hit = self._gf.get(size)
        if hit is None:
            f, g = self.degrees(size)
            hit = self._gf[size] = (float(g.min()), float(f.min()))
        return hit

    # -- per step ------------------------------------------------------------------------
    def _tables(self, step: Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(f_k, g_k) of the step's distinct sizes as [size, degree] arrays and each size's count."""
        uniq: dict[Size, int] = {}
        sizes = self.ctx.sizes
        for i in step.sample_ids:
            s = sizes[i]
            uniq[s] = uniq.get(s, 0) + 1
        fg = [self.degrees(s) for s in uniq]
        return (np.array([x[0] for x in fg]), np.array([x[1] for x in fg]), np.array(list(uniq.values()), dtype=float))

    def simple(self, step: Step) -> float:
        """The simple compute bound: max(sum g / world, max f)."""
        gs, fmax = 0.0, 0.0
        sizes = self.ctx.sizes
        if self.ctx.model.kind != "video":  # every new size's shares at once
            self.shares(sizes[i] for i in step.sample_ids)
        for i in step.sample_ids:
            g, f = self.sample(sizes[i])
            gs += g
            fmax = max(fmax, f)
        return max(gs / self.world, fmax)

    def compute(self, step: Step) -> float:
        """The step's compute bound: the largest of the bounds computed for it."""
        out = self.simple(step)
        if self.ctx.model.kind == "video":  # whole micro-batches of one shape (`plan.shape_bound`)
            out = shape_bound(self, step, out)
        out = max(out, self.midpoint(step))
        if len(step.sample_ids) <= self.per_rank_per_gpu * self.world and self.ctx.model.kind == "video":
            out = max(out, self.per_rank(step, out))
        return out

    def step(self, step: Step) -> float:
        return self.with_sync(self.compute(step))

    def simple_step(self, step: Step) -> float:
        """The step bound from the simple compute bound alone."""
        return self.with_sync(self.simple(step))

    def with_sync(self, compute: float) -> float:
        """A step bound from a compute bound: plus the gradient sync that compute cannot hide."""
        ctx = self.ctx
        buckets = sync_buckets(ctx.cost.model.trainable_params, ctx.cluster.shard_size, ctx.cluster.world_size)
        return compute + exposed_sync(ctx.cost.grad_sync_time(), compute, buckets)

    def epoch(self, steps: Iterable[Step]) -> float:
        return sum(self.step(s) for s in steps)

    # -- the midpoint bound --------------------------------------------------------------
    def midpoint(self, step: Step) -> float:
        """The midpoint compute bound (the module docstring): on the first interval between
        breakpoints (found by binary search) whose LP value fits, max(its start, V / world)."""
        f, g, cnt = self._tables(step)
        sp = np.asarray(self.ctx.mix_sizes, dtype=float)
        world = float(self.world)
        b = breakpoints(f)
        ends = np.append(b[1:], np.inf)
        vals: dict[int, float] = {}

        def ok(j: int) -> bool:  # is some T in [b_j, b_j+1) feasible?
            if j not in vals:
                vals[j] = lp_value(*interval(f, g, cnt, sp, float(b[j]), float(ends[j])), cnt, world)
            return vals[j] <= world * ends[j]

        lo, hi = 0, len(b) - 1  # the last interval is always feasible (no long samples, any work)
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        ok(lo)
        # every T in [b_j, V_j / world) is infeasible, and so is every T below b_j (interval
        # j - 1 was tested infeasible, or b_j is the first breakpoint: some sample fits no
        # degree below it), whether or not feasibility is monotone in T. A tiny slack keeps
        # rounding from raising the bound.
        return max(float(b[lo]), vals[lo] * (1 - 1e-12) / world)

    # -- the per-rank bound (video) ------------------------------------------------------
    def shape_options(self, step: Step) -> list[tuple[int, np.ndarray]]:
        """Per latent shape of the step (`PlanContext.bucket_of`: what one video micro-batch
        may hold): its samples and its options as rows (k, m, tau_k(m)), tau the fastest
        fitting time of m copies (of the shape's quickest size that fits m, if it has several),
        m up to its samples and the most copies of any of its sizes that fit."""
        ctx = self.ctx
        shapes: dict = {}
        for i in step.sample_ids:
            shapes.setdefault(ctx.bucket_of[i], []).append(ctx.sizes[i])
        out = []
        for sizes in shapes.values():
            uniq, rows = set(sizes), []
            for k in ctx.mix_sizes:
                # any number of copies that fits, not only the planners' 64 (`packed` stacks more)
                tops = {z: ctx.max_mbs(z, k, "pac", cap=len(sizes)) for z in uniq}
                for m in range(1, min(max(tops.values()), len(sizes)) + 1):
                    rows.append((k, m, self.copies_time([z for z in uniq if tops[z] >= m], m, k)))
            out.append((len(sizes), np.array(rows, dtype=float).reshape(-1, 3)))
        return out

    def copies_time(self, sizes, m: int, k: int) -> float:
        """tau_k(m): the least time of m copies of any of `sizes` at degree k (fastest fitting recompute)."""
        return min(self.ctx.copies_layout(z, m, k, "pac").time for z in sizes)

    def per_rank(self, step: Step, floor: float = 0.0) -> float:
        """The per-rank compute bound, at least `floor` (a valid bound found otherwise): the
        largest T from there that a bisection proves infeasible (`per_rank_feasible`)."""
        opts = self.shape_options(step)
        world = float(self.world)
        lo = max(floor, max(float(o[:, 2].min()) for _, o in opts))  # some sample is never faster
        hi = lo
        while not per_rank_feasible(opts, hi, world):
            lo, hi = hi, hi * 2.0
        return bisect_too_short(lambda T: per_rank_feasible(opts, T, world), lo, hi)


def breakpoints(f: np.ndarray) -> np.ndarray:
    """The midpoint bound's breakpoints: every f_k and 2 f_k from max_s min_k f_k on, sorted
    (which degrees a sample may use, and where it is long, change only there)."""
    fmax = float(f.min(axis=1).max())
    fin = f[np.isfinite(f)]
    b = np.unique(np.concatenate([fin, 2.0 * fin]))
    return b[b >= fmax]


def interval(f: np.ndarray, g: np.ndarray, cnt: np.ndarray, sp: np.ndarray, lo: float, hi: float):
    """The midpoint LP's (G, R) on the makespans T in [lo, hi) (no f or 2f strictly inside): a
    sample may use degree k if f_k <= T (G = g_k, else inf); it is long at k if f_k > T/2, and
    then holds k / Q midpoint ranks (R), Q an upper bound on the long samples of its micro-batch.

    Q: the micro-batch's GPU-seconds, at most k * hi, cover the g_k of all its samples, so with
    s it holds at most the J samples long at k of the smallest g_k whose sum fits in
    k * hi - g_k(s) (counting s among them only makes J larger), and at most all of them."""
    usable = f <= lo
    long = usable & (2.0 * f > lo)
    G = np.where(usable, g, np.inf)
    R = np.zeros_like(g)
    for c, k in enumerate(sp):
        rows = np.flatnonzero(long[:, c])
        if not len(rows):
            continue
        gl, cl = g[rows, c], cnt[rows]
        order = np.argsort(gl)
        gs, cs = gl[order], cl[order]
        S = np.concatenate([[0.0], np.cumsum(gs * cs)])  # the sum of the first i sizes' samples
        C = np.concatenate([[0.0], np.cumsum(cs)])
        room = k * hi - gl  # inf on the last interval
        room = room * (1 + 1e-12) + 1e-15  # rounding can only let more in
        i = np.searchsorted(S, room, side="right") - 1  # whole sizes that fit
        part = np.zeros_like(room)
        inside = i < len(gs)
        ii = i[inside]
        part[inside] = np.minimum(cs[ii], np.floor((room[inside] - S[ii]) / gs[ii] + 1e-9))
        J = C[np.minimum(i, len(gs))] + part
        Q = np.clip(1.0 + J, 1.0, C[-1])
        R[rows, c] = k / Q
    return G, R


def lp_value(G: np.ndarray, R: np.ndarray, cnt: np.ndarray, world: float, iters: int = 200) -> float:
    """A lower estimate of V = min sum_s g subject to sum_s r <= world (each sample a convex mix
    of its options; G = inf where an option is unusable): the largest value of the dual
    D(lambda) = sum_s min_o (G + lambda R) - lambda world that a cutting-plane search over
    lambda >= 0 evaluates. Exact when the search converges; never above V, as every D(lambda)
    is a lower bound of V. inf when no mix can meet the rank limit."""
    if not np.isfinite(G.min(axis=1)).all():
        return float("inf")  # a sample with no usable option
    Rm = np.where(np.isfinite(G), R, np.inf)
    if float((cnt * Rm.min(axis=1)).sum()) > world * (1 + 1e-9):
        return float("inf")  # even the fewest midpoint ranks of every sample exceed the world

    def dual(lam: float) -> tuple[float, float, float]:
        """D(lam) and its right and left slopes."""
        v = G + lam * R
        vmin = v.min(axis=1)
        tie = v <= vmin[:, None] + 1e-12 * (np.abs(vmin[:, None]) + 1e-30)
        right = float((cnt * np.where(tie, R, np.inf).min(axis=1)).sum()) - world
        left = float((cnt * np.where(tie, R, -np.inf).max(axis=1)).sum()) - world
        return float((cnt * vmin).sum()) - lam * world, right, left

    # every lambda evaluated gives (D, right slope, left slope): right <= 0 <= left is a
    # maximiser; right > 0 a point left of the maximum, left < 0 one right of it. A slope
    # within `tol` of 0 counts as 0: the fewest ranks may sum to the world exactly (ten samples
    # of 1/10 rank each), which rounding can put a few ulps above it, and D would then seem to
    # rise forever. Stopping there early only lowers the value returned.
    tol = 1e-9 * world
    lo, (dlo, slo, _) = 0.0, dual(0.0)
    best = dlo
    if slo <= tol:  # no gain from any lambda > 0: the work constraint alone decides
        return best
    hi = max(float(G[np.isfinite(G)].max()), 1e-9)
    for _ in range(200):  # a lambda right of the maximum
        dhi, rs, shi = dual(hi)
        best = max(best, dhi)
        if rs <= tol and shi >= -tol:
            return best
        if shi < -tol:
            break
        lo, dlo, slo = hi, dhi, rs
        hi *= 2.0
    else:
        return best  # (not reached: the rank limit checked above makes a slope fall to tol first)
    for _ in range(iters):
        lam = (dhi - dlo + slo * lo - shi * hi) / (slo - shi)  # where the two supporting lines meet
        lam = min(max(lam, lo), hi)
        top = dlo + slo * (lam - lo)  # the two lines' maximum: no D is above it
        dx, rx, lx = dual(lam)
        best = max(best, dx)
        if top - dx <= 1e-12 * max(abs(top), 1e-30) or (rx <= tol and lx >= -tol):
            return best
        if rx > 0:
            lo, dlo, slo = lam, dx, rx
        else:
            hi, dhi, shi = lam, dx, lx
        if hi - lo <= 1e-15 * hi:
            return best
    return best


def per_rank_feasible(opts: list[tuple[int, np.ndarray]], T: float, world: float) -> bool:
    """Whether some mix of the shapes' options with tau <= T meets, for every threshold e,
    sum over shapes of n * sum_o x_o * k * u_e(tau / T) / m <= world, and the same for every
    step function u^(q) (`step_dff`, all in every LP) (the per-rank bound's LP;
    `LowerBound.shape_options`). False proves that no schedule ends by T. Solved by adding
    thresholds: the LP over a few of them, then the ones its mix breaks most, until the mix
    meets all (feasible) or a subset has no mix (infeasible: so has the whole). Only the rows
    of the thresholds in the LP are built; a mix is checked against all of them by prefix sums
    over the options sorted by tau / T (memory grows with options plus thresholds, not with
    their product)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    usable = [o[o[:, 2] <= T * (1 + 1e-12)] for _, o in opts]
    if any(len(u) == 0 for u in usable):
        return False
    x = np.concatenate([u[:, 2] for u in usable]) / T
    nk = np.concatenate([n * u[:, 0] for (n, _), u in zip(opts, usable)])
    m = np.concatenate([u[:, 1] for u in usable])
    es = np.concatenate([PER_RANK_EPS, x, 1.0 - x + 1e-9])
    es = np.unique(es[(es >= 0.0) & (es <= 0.5)])
    of = np.concatenate([np.full(len(u), j) for j, u in enumerate(usable)])
    eq = coo_matrix((np.ones(len(of)), (of, np.arange(len(of)))), shape=(len(usable), len(of)))
    cap = world * (1 + 1e-9)
    srt = np.argsort(x)
    xs = x[srt]
    active = np.flatnonzero(np.isin(es, PER_RANK_EPS))
    step_rows = nk[None, :] * step_dff(x[None, :], np.arange(1, PER_RANK_STEPS + 1)[:, None]) / m[None, :]
    while True:
        # [e or q, option]: the thresholds in the LP, then every step function
        rows = np.vstack([nk[None, :] * dff(x[None, :], es[active][:, None]) / m[None, :], step_rows])
        res = linprog(
            np.zeros(len(of)),
            A_ub=rows,
            b_ub=np.full(len(rows), cap),
            A_eq=eq,
            b_eq=np.ones(len(usable)),
            bounds=(0, None),
            method="highs",
        )
        if res.status == 2:  # infeasible: proven
            return False
        if res.status != 0:  # the solver could not tell (numerical trouble): nothing is proven
            return True
        over = threshold_sums(xs, (nk / m * res.x)[srt], es) - cap
        over[active] = -np.inf
        if over.max() <= 1e-9 * world:
            return True
        active = np.union1d(active, np.argsort(-over)[:16])


def step_dff(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """u^(q)(x) = floor((q + 1) x (1 - d)) / q, d = 1e-9, a dual feasible function for every
    whole q >= 1: x's summing to at most 1 (to rounding far below d) give floors summing to
    at most (1 - d)(q + 1) < q + 1, so to at most q, and their u^(q) to at most 1. (The d also
    keeps micro-batches of exactly 1 / (q + 1) of T, q + 1 of which fit a rank, at the floor
    below.)"""
    return np.floor((q + 1) * x * (1 - 1e-9)) / q


def threshold_sums(xs: np.ndarray, a: np.ndarray, es: np.ndarray) -> np.ndarray:
    """sum_o a_o * u_e(x_o) for every e of `es`, the x_o sorted ascending (`xs`): the options
    above 1 - e count whole, those in [e, 1 - e] count x_o, those below e nothing; by prefix
    sums, without the [e, option] matrix."""
    whole = np.concatenate([[0.0], np.cumsum(a)])
    part = np.concatenate([[0.0], np.cumsum(a * xs)])
    lo = np.searchsorted(xs, es, side="left")  # first x >= e
    hi = np.searchsorted(xs, 1.0 - es, side="right")  # first x > 1 - e
    return (whole[-1] - whole[hi]) + (part[np.maximum(hi, lo)] - part[lo])
