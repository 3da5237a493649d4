"""Tighter step lower bounds than `plan.bounds.LowerBound`, for the scale report: they show
where the official bound is loose (few samples per GPU), without replacing it.

The layout model all four share (the official bound's): a micro-batch runs on a group of k
ranks (an SP degree of the context) for its whole time, and a rank runs one micro-batch at a
time (as `sim.replay` does). The official, tight and midpoint bounds also rest on (A1) and (A2)
below; the per-rank bound (video only) replaces them with the exact time of copies.

Per sample s and degree k, f_k(s) is the time of s alone at k
and g_k(s) the fewest GPU-seconds per sample of micro-batches of copies of s at k (time * k /
m over m in `mbs_candidates(ctx.max_mbs(s, k, "pac"))`, the fastest recompute that fits). A
micro-batch B at degree k, of time d, is assumed to satisfy

    (A1) f_k(s) <= d for each of its samples (a sample does not run faster in company),
    (A2) sum over its samples of g_k(s) <= k * d (no sample costs fewer GPU-seconds than in
         its best micro-batch of copies; the official bound's assumption).

Official bound: max(sum_s g(s) / world, max_s f(s)), with g = min_k g_k and f = min_k f_k;
the two may come from different SP degrees (g from a narrow group, f from the widest).

Tight bound (`TightBound.compute`): a step that finishes by T cannot run s at a degree k
where s alone takes longer than T (A1), so

    bound_T(step) = min T such that T >= max_s f(s) and sum_s g_T(s) <= world * T,
    g_T(s) = min over degrees k with f_k(s) <= T of g_k(s).

Midpoint bound (`TightBound.midpoint`): it also counts the ranks that long micro-batches hold
at once. Take any schedule of the step that ends by T and look at the instant T/2: a
micro-batch longer than T/2 lies in [0, T] in an interval of length > T/2, and every such
interval contains T/2, so all of them run at that instant, on disjoint ranks: their degrees
sum to at most world. Call s long at k when f_k(s) > T/2; by (A1) the micro-batch of a long
sample is longer than T/2. Count only those micro-batches, and split the k ranks of each over
its long samples: a long sample holds k / q midpoint ranks, q the long samples of its
micro-batch. By (A2) the g_k of its samples fit in k * T, so q <= Q_k(s, T), the largest
number of samples long at k, s among them, whose g_k sum to at most k * T (`interval`); a long
sample gets r = k / Q_k(s, T), any other r = 0. Relax each sample's degree to a convex mix (an
LP): T is feasible only if there is a mix, over the degrees with f_k(s) <= T, with

    sum_s g_k(s) <= world * T   and   sum_s r <= world.

Minimising sum_s g subject to the rank limit has the Lagrangian dual

    V(T) = max over lambda >= 0 of D(lambda),
    D(lambda) = sum_s min_k (g_k + lambda * r_k) - lambda * world

(equal by LP duality; V = inf when even the fewest midpoint ranks exceed world), so T is
feasible iff V(T) <= world * T, and any lambda with D(lambda) > world * T proves T infeasible.
D is concave and piecewise linear; a cutting-plane search over its pieces maximises it, and
what is used is the largest D actually evaluated, which can only under-estimate V (the bound
stays valid if the search stops early; `--check` compares it with an exact primal solution).

Which degrees a sample may use and where it is long change only at the values f_k (usable
from there) and 2 f_k (long below it): the bound scans the intervals [b_j, b_j+1) between
consecutive breakpoints, taking Q at T = b_j+1 (the most room, the fewest ranks: valid for the
whole interval), and binary-searches for the first interval with V_j <= world * b_j+1; it
returns max(b_j, V_j / world). That is valid whether or not feasibility is monotone in T (it
nearly is; Q can shrink as T grows): the interval before was tested infeasible, and so is
every T below max_s min_k f_k, the first breakpoint. With lambda = 0 the LP's work test is the
tight bound's, so the midpoint bound is never below it (`midpoint` returns the larger of the
two where rounding leaves it ~1e-12 below; both are valid).

Not the bound as first specified, over layouts (k, m) with the copies time t_o <= T and
r_o = k / m when t_o > T/2: real plans mix samples of different lengths in one micro-batch,
whose time is not that of copies of either. E.g. (text, 16 GPUs) samples of 67932 and 43676
tokens in one micro-batch at sp 16 take 1.612 s, but two copies of the longer one exceed that
time, so that version put the step's bound at 1.654 s, above the 1.613 s of the plan `packed` made
(`--check` found it). It gave bounds 4-6% above the tight bound at strong 512 text; this one, 0.2-0.6%.

Per-rank bound (`TightBound.per_rank`, video only): a video micro-batch stacks samples of one
latent shape (`spec.batch_key`), so its time is that of m copies of one size at its degree k,
with no assumption about mixing: at least tau_k(m), the fastest recompute that fits. Take any
schedule of the step that ends by T. The micro-batches a rank runs one after another have
durations that sum to at most T; a dual feasible function u (u(x) + u(y) + ... <= 1 whenever
x + y + ... <= 1) keeps that true of u(d / T), so summed over the ranks

    sum over micro-batches of k * u(d / T) <= world.

Here u_e(x) = 1 for x > 1 - e, 0 for x < e, x between (0 <= e <= 1/2; e = 0 is the work
bound, e = 1/2 counts the micro-batches longer than T/2 as the midpoint bound does), and u is
non-decreasing, so tau may stand for d. Splitting each micro-batch's k * u over its m samples
and relaxing every shape's samples to a mix of options (k, m) with tau_k(m) <= T (m at most the
shape's samples in the step), T is feasible only if one mix meets the inequalities of every e
tried at once: a feasibility LP (HiGHS through scipy), with e over a fixed grid and the step's
own thresholds (x and just above 1 - x of each option). A T whose LP is infeasible proves that
no schedule ends by T, whatever happens at other T, so the bound is the largest T a bisection
finds infeasible. It counts what the midpoint bound cannot: a rank that runs a long
micro-batch has no room left for a medium one, however short that is against T/2. For text
(micro-batches mix lengths, and their time is not that of copies) it is not computed.

All four add the same exposed gradient sync (`cost.overlap.exposed_sync` of the compute
bound: sync minus what the last backward can hide, at least the last bucket); compute +
exposed sync grows with compute, so a larger compute bound gives a larger step bound.

    PYTHONPATH=. .venv/bin/python benchmarks/tight_bound.py --check   # validity checks

The per-rank bound needs scipy (`pip install -e '.[milp]'`).
"""

from __future__ import annotations

import numpy as np

from dcparallel.cost.overlap import exposed_sync, num_buckets
from dcparallel.plan.context import PlanContext, mbs_candidates
from dcparallel.plan.steps import Step


class TightBound:
    def __init__(self, ctx: PlanContext):
        self.ctx = ctx
        self._fg: dict = {}
        self._mid: dict = {}
        self._per_rank: dict = {}

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

    # -- the midpoint bound ------------------------------------------------------------
    def _tables(self, step: Step):
        """(f_k, g_k) of the step's distinct sizes as (sizes x degrees) arrays (`sample`), each
        size's count and the degrees."""
        ctx = self.ctx
        uniq: dict = {}
        for i in step.sample_ids:
            s = ctx.sizes[i]
            uniq[s] = uniq.get(s, 0) + 1
        f = np.array([self.sample(s)[0] for s in uniq])
        g = np.array([self.sample(s)[1] for s in uniq])
        return f, g, np.array(list(uniq.values()), dtype=float), np.asarray(ctx.sp_sizes, dtype=float)

    @staticmethod
    def interval(f: np.ndarray, g: np.ndarray, cnt: np.ndarray, sp: np.ndarray, lo: float, hi: float):
        """The LP's (G, R) on the makespans T in [lo, hi) (no f or 2f strictly inside): a sample
        may use degree k if f_k <= T (G = g_k, else inf); it is long at k if f_k > T/2, and then
        holds k / Q midpoint ranks (R), Q an upper bound on the long samples of its micro-batch.

        Q: the micro-batch's GPU-seconds, at most k * hi, cover the g_k of all its samples, so
        with s it holds at most the J samples long at k of the smallest g_k whose sum fits in
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

    @staticmethod
    def breakpoints(f: np.ndarray) -> np.ndarray:
        """The sorted breakpoints f_k and 2 f_k from max_s min_k f_k on."""
        fmax = float(f.min(axis=1).max())
        fin = f[np.isfinite(f)]
        b = np.unique(np.concatenate([fin, 2.0 * fin]))
        return b[b >= fmax]

    @staticmethod
    def lp_value(G: np.ndarray, R: np.ndarray, cnt: np.ndarray, world: float, iters: int = 200) -> float:
        """A lower estimate of V = min sum_s g subject to sum_s r <= world (each sample a convex
        mix of its options; G = inf where an option is unusable): the largest value of the dual
        D(lambda) = sum_s min_o (G + lambda R) - lambda world that a cutting-plane search over
        lambda >= 0 evaluates. Exact when the search converges (it does on every step seen); never
        above V, as every D(lambda) is a lower bound of V. inf when no mix can meet the rank limit."""
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
        # maximiser; right > 0 a point left of the maximum, left < 0 one right of it
        lo, (dlo, slo, _) = 0.0, dual(0.0)
        best = dlo
        if slo <= 0:  # no gain from any lambda > 0: the work constraint alone decides
            return best
        hi = max(float(G[np.isfinite(G)].max()), 1e-9)
        for _ in range(200):  # a lambda right of the maximum
            dhi, rs, shi = dual(hi)
            best = max(best, dhi)
            if rs <= 0 <= shi:
                return best
            if shi < 0:
                break
            lo, dlo, slo = hi, dhi, rs
            hi *= 2.0
        else:
            return best  # (the rank limit is met with no slack to spare: D rises forever)
        for _ in range(iters):
            lam = (dhi - dlo + slo * lo - shi * hi) / (slo - shi)  # where the two supporting lines meet
            lam = min(max(lam, lo), hi)
            top = dlo + slo * (lam - lo)  # the two lines' maximum: no D is above it
            dx, rx, lx = dual(lam)
            best = max(best, dx)
            if top - dx <= 1e-12 * max(abs(top), 1e-30) or rx <= 0 <= lx:
                return best
            if rx > 0:
                lo, dlo, slo = lam, dx, rx
            else:
                hi, dhi, shi = lam, dx, lx
            if hi - lo <= 1e-15 * hi:
                return best
        return best

    def midpoint(self, step: Step, scan: bool = False, raw: bool = False, exact: bool = False) -> float:
        """The compute part of the midpoint bound (no sync): the LP's answer, or the tight bound
        where rounding leaves that a hair (~1e-12) below it (both are valid). For the checks:
        `scan` tests every interval in order instead of binary search, `raw` returns the LP's
        answer alone, `exact` scans with the plain `interval_naive` and `lp_exact` instead."""
        key = (step.sample_ids, scan or exact, exact)
        got = self._mid.get(key)
        if got is None:
            got = self._mid[key] = (self._midpoint(step, True, lp_exact, interval_naive) if exact
                                    else self._midpoint(step, scan, self.lp_value, self.interval))
        return got if raw else max(got, self.compute(step))

    def _midpoint(self, step: Step, scan: bool, lp, interval) -> float:
        f, g, cnt, sp = self._tables(step)
        world = float(self.ctx.cluster.world_size)
        b = self.breakpoints(f)
        ends = np.append(b[1:], np.inf)
        vals: dict[int, float] = {}

        def ok(j: int) -> bool:  # is some T in [b_j, b_j+1) feasible?
            if j not in vals:
                vals[j] = lp(*interval(f, g, cnt, sp, float(b[j]), float(ends[j])), cnt, world)
            return vals[j] <= world * ends[j]

        if scan:
            j = next(j for j in range(len(b)) if ok(j))
        else:
            lo, hi = 0, len(b) - 1  # the last interval is always feasible (no long samples, any work)
            while lo < hi:
                mid = (lo + hi) // 2
                if ok(mid):
                    hi = mid
                else:
                    lo = mid + 1
            j = lo
            ok(j)
        # every T in [b_j, V_j / world) is infeasible, and so is every T below b_j (interval
        # j - 1 was tested infeasible, or b_j is the first breakpoint: some sample fits no
        # degree below it), whether or not feasibility is monotone in T. V_j may be under-
        # estimated (the bound can only fall); a tiny slack keeps rounding from raising it.
        return max(float(b[j]), vals[j] * (1 - 1e-12) / world)

    def midpoint_step(self, step: Step) -> float:
        ctx = self.ctx
        compute = self.midpoint(step)
        return compute + exposed_sync(ctx.cost.grad_sync_time(), compute, num_buckets(ctx.cost.model.num_params))

    def ffd_makespan(self, step: Step) -> float:
        """Not a bound: the makespan of a simple per-sample plan, for comparison — for a target
        T every sample runs alone at the narrowest degree that finishes it within T, the samples
        of one degree are packed first-fit decreasing into groups of capacity T, and the
        smallest T whose groups fit the world wins (one phase, no micro-batches of several
        samples, no idle ranks reused)."""
        ctx = self.ctx
        sp = np.asarray(ctx.sp_sizes)
        f = np.array([self.sample(ctx.sizes[i])[0] for i in step.sample_ids])
        for T in np.unique(f[np.isfinite(f)]):
            ok = f <= T
            if not ok.any(axis=1).all():
                continue
            kidx = ok.argmax(axis=1)
            t, k = f[np.arange(len(f)), kidx], sp[kidx]
            ranks = 0
            for kk in np.unique(k):
                bins: list[float] = []
                for x in sorted(t[k == kk].tolist(), reverse=True):
                    for b in range(len(bins)):
                        if bins[b] + x <= T:
                            bins[b] += x
                            break
                    else:
                        bins.append(x)
                ranks += int(kk) * len(bins)
            if ranks <= ctx.cluster.world_size:
                return float(T)
        return float("inf")

    def step(self, step: Step) -> float:
        ctx = self.ctx
        compute = self.compute(step)
        return compute + exposed_sync(ctx.cost.grad_sync_time(), compute, num_buckets(ctx.cost.model.num_params))

    # -- the per-rank bound (video) --------------------------------------------------------
    def shape_options(self, step: Step) -> list[tuple[int, np.ndarray]] | None:
        """Per latent shape of the step (`PlanContext.bucket_of`: what one micro-batch may
        hold): its samples and its options as rows (k, m, tau_k(m)), tau the fastest fitting
        time of m copies (of the shape's quickest size that fits m, if it has several), m up to
        its samples and the most copies of any of its sizes that fit. None for text."""
        ctx = self.ctx
        if ctx.model.kind != "video":
            return None
        shapes: dict = {}
        for i in step.sample_ids:
            shapes.setdefault(ctx.bucket_of[i], []).append(ctx.sizes[i])
        out = []
        for sizes in shapes.values():
            uniq, rows = set(sizes), []
            for k in ctx.sp_sizes:
                # any number of copies that fits, not only the planners' 64 (`packed` stacks more)
                tops = {z: ctx.max_mbs(z, k, "pac", cap=len(sizes)) for z in uniq}
                for m in range(1, min(max(tops.values()), len(sizes)) + 1):
                    rows.append((k, m, self.copies_time([z for z in uniq if tops[z] >= m], m, k)))
            out.append((len(sizes), np.array(rows, dtype=float).reshape(-1, 3)))
        return out

    def copies_time(self, sizes, m: int, k: int) -> float:
        """tau_k(m): the least time of m copies of any of `sizes` at degree k (fastest fitting recompute)."""
        return min(self.ctx.copies_layout(z, m, k, "pac")[1] for z in sizes)

    def per_rank(self, step: Step) -> float:
        """The compute part of the per-rank bound (video; 0.0 for text): the largest T the
        bisection proves infeasible (`per_rank_feasible`), at least the longest sample's
        fastest time."""
        got = self._per_rank.get(step.sample_ids)
        if got is not None:
            return got
        opts = self.shape_options(step)
        if opts is None:
            return 0.0
        world = float(self.ctx.cluster.world_size)
        lo = max(float(o[:, 2].min()) for _, o in opts)  # some sample is never faster
        hi = lo
        while not per_rank_feasible(opts, hi, world):
            lo, hi = hi, hi * 2.0
        for _ in range(40):  # lo: proven infeasible (or the trivial bound); hi: feasible
            if hi - lo <= 1e-7 * hi:
                break
            mid = (lo + hi) / 2
            if per_rank_feasible(opts, mid, world):
                hi = mid
            else:
                lo = mid
        self._per_rank[step.sample_ids] = lo
        return lo

    def per_rank_step(self, step: Step) -> float:
        ctx = self.ctx
        compute = self.per_rank(step)
        return compute + exposed_sync(ctx.cost.grad_sync_time(), compute, num_buckets(ctx.cost.model.num_params))

    def best_step(self, step: Step) -> float:
        """The larger of the midpoint and (video) per-rank bounds of the step, sync included."""
        return max(self.midpoint_step(step), self.per_rank_step(step) if self.ctx.model.kind == "video" else 0.0)


#: the per-rank bound's thresholds e tried at every T, besides the step's own (see the docstring)
PER_RANK_EPS = (0.0, 0.1, 0.2, 0.25, 0.3, 1 / 3, 0.4, 0.5)


def dff(x: np.ndarray, e: np.ndarray) -> np.ndarray:
    """u_e(x): 1 above 1 - e, 0 below e, x between (a dual feasible function for e <= 1/2)."""
    return np.where(x > 1 - e, 1.0, np.where(x < e, 0.0, x))


def per_rank_feasible(opts: list[tuple[int, np.ndarray]], T: float, world: float) -> bool:
    """Whether some mix of the shapes' options with tau <= T meets, for every threshold e,
    sum over shapes of n * sum_o x_o * k * u_e(tau / T) / m <= world (the LP of the
    per-rank bound; `TightBound.shape_options`). False proves that no schedule ends by T.
    Solved by adding thresholds: the LP over a few of them, then the ones its mix breaks most,
    until the mix meets all (feasible) or a subset has no mix (infeasible: so has the whole)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    usable = [o[o[:, 2] <= T * (1 + 1e-12)] for _, o in opts]
    if any(len(u) == 0 for u in usable):
        return False
    x = np.concatenate([u[:, 2] for u in usable]) / T
    es = np.concatenate([PER_RANK_EPS, x, 1.0 - x + 1e-9])
    es = np.unique(es[(es >= 0.0) & (es <= 0.5)])
    w = np.concatenate([n * u[None, :, 0] * dff(u[None, :, 2] / T, es[:, None]) / u[None, :, 1]
                        for (n, _), u in zip(opts, usable)], axis=1)  # [e, option]
    of = np.concatenate([np.full(len(u), j) for j, u in enumerate(usable)])
    eq = coo_matrix((np.ones(len(of)), (of, np.arange(len(of)))), shape=(len(usable), len(of)))
    cap = world * (1 + 1e-9)
    active = np.flatnonzero(np.isin(es, PER_RANK_EPS))
    while True:
        res = linprog(np.zeros(len(of)), A_ub=w[active], b_ub=np.full(len(active), cap), A_eq=eq,
                      b_eq=np.ones(len(usable)), bounds=(0, None), method="highs")
        if res.status == 2:  # infeasible: proven
            return False
        if res.status != 0:  # the solver could not tell (numerical trouble): nothing is proven
            return True
        over = w @ res.x - cap
        over[active] = -np.inf
        if over.max() <= 1e-9 * world:
            return True
        active = np.union1d(active, np.argsort(-over)[:16])


def lp_exact(G: np.ndarray, R: np.ndarray, cnt: np.ndarray, world: float) -> float:
    """For the checks, an independent exact solution of `TightBound.lp_value`'s LP, in the
    primal: every size starts at its fewest midpoint ranks (the fewest GPU-seconds among
    those), then moves along the lower convex hull of its (r, g) options; the moves of all
    sizes are taken in order of GPU-seconds saved per rank until the ranks run out."""
    base_g, base_r, segs = 0.0, 0.0, []
    for Gi, Ri, c in zip(G, R, cnt):
        ok = np.isfinite(Gi)
        if not ok.any():
            return float("inf")
        pts = sorted(set(zip(Ri[ok].tolist(), Gi[ok].tolist())))
        r0 = pts[0][0]
        g0 = min(g for r, g in pts if r == r0)
        base_g, base_r = base_g + c * g0, base_r + c * r0
        cur = (r0, g0)
        while True:  # the next hull vertex: the steepest fall in g per rank
            nxt = [((g - cur[1]) / (r - cur[0]), -r, r, g) for r, g in pts if r > cur[0] and g < cur[1]]
            if not nxt:
                break
            slope, _, r, g = min(nxt)
            segs.append((slope, c * (r - cur[0])))
            cur = (r, g)
    if base_r > world * (1 + 1e-9):
        return float("inf")
    left, v = world - base_r, base_g
    for slope, length in sorted(segs):
        if left <= 0:
            break
        take = min(left, length)
        v, left = v + slope * take, left - take
    return v


def interval_naive(f: np.ndarray, g: np.ndarray, cnt: np.ndarray, sp: np.ndarray, lo: float, hi: float):
    """For the checks: `TightBound.interval` sample by sample, Q by adding the samples long at k
    one at a time in order of g_k (s among them) while their sum fits in k * hi - g_k(s)."""
    G = np.where(f <= lo, g, np.inf)
    R = np.zeros_like(g)
    for c, k in enumerate(sp):
        long = [i for i in range(len(f)) if lo / 2 < f[i, c] <= lo]
        pool = sorted(x for i in long for x in [g[i, c]] * int(cnt[i]))
        for i in long:
            room, q = k * hi - g[i, c], 1
            for x in pool:
                if x > room * (1 + 1e-12):
                    break
                room, q = room - x, q + 1
            R[i, c] = k / min(q, len(pool))
    return G, R


def midpoint_exact(tb: TightBound, step: Step) -> float:
    """For the checks: the midpoint bound by `interval_naive` and `lp_exact` on every interval in order."""
    return tb.midpoint(step, raw=True, exact=True)


def official_compute(ctx: PlanContext, step: Step) -> float:
    """`LowerBound.step` without its sync: max(sum g / world, max f)."""
    from dcparallel.plan.bounds import LowerBound

    lb = LowerBound(ctx)
    gf = [lb.sample(ctx.sizes[i]) for i in step.sample_ids]
    return max(sum(g for g, _ in gf) / ctx.cluster.world_size, max(f for _, f in gf))


def build_cell(scenario: str, dist: str, world: int, tps: int, min_steps: int):
    """The context and steps of a cell as `sim_scale.run_cell` builds them (all its steps)."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.plan.steps import form_steps
    from dcparallel.scenarios import EPOCH_STEPS, SCENARIOS, sample_sizes
    from dcparallel.spec import Workload

    sc = SCENARIOS[scenario]
    wl = Workload(sc.model, tuple(sample_sizes(scenario, dist, epoch_tokens=max(
        EPOCH_STEPS * sc.tokens_per_step, min_steps * tps))))
    cl = sc.cluster(world)
    ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
    return ctx, form_steps(wl.tokens, seed=0, tokens_per_step=tps)


def check(worlds=(8, 16), real_steps: int = 2, small_steps: int = 6, seed: int = 0) -> int:
    """The validity checks, as asserts: on the weak cells' contexts at `worlds` (both scenarios,
    every distribution), for their first `real_steps` steps and `small_steps` random steps of
    2-10 samples:
      (a) midpoint bound (the LP's answer alone, to 1e-9) >= tight bound >= the official bound's
          compute part;
      (b) midpoint bound (with sync) <= the simulated time of the plans of "dcp", "bucket" and
          "packed" for the step (each step planned and simulated alone);
      (c) on steps of at most 64 distinct sizes, the midpoint bound's binary search and
          cutting-plane LP agree with a scan of every interval by an exact primal LP
          (`midpoint_exact`);
      (d) video: the per-rank bound (with sync) <= the same simulated plans, and every planned
          micro-batch takes at least the tau_k(m) the bound gives its shape (its one assumption).
    It also reports how far the planned micro-batches are from the model's two assumptions
    (per micro-batch at degree k: f_k(s) <= its time for each of its samples, and the sum of
    their g_k <= k * its time): the worst ratio of each, <= 1 where they hold."""
    import time

    from dcparallel.plan.policies import make_planner
    from dcparallel.plan.steps import Step
    from dcparallel.scenarios import DISTRIBUTIONS, SCENARIOS
    from dcparallel.sim.replay import simulate, step_seconds

    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    # (c') the cutting-plane dual against the exact primal on random LPs where the rank limit binds
    lp_gap, binding, lp_rng = 0.0, 0, np.random.default_rng(seed + 1)
    for _ in range(500):
        u, o = int(lp_rng.integers(1, 30)), int(lp_rng.integers(1, 7))
        G = lp_rng.uniform(1, 10, (u, o)) * np.where(lp_rng.random((u, o)) < 0.15, np.inf, 1.0)
        G[np.arange(u), lp_rng.integers(0, o, u)] = lp_rng.uniform(1, 10, u)  # every row has an option
        R = np.where(lp_rng.random((u, o)) < 0.4, 0.0, lp_rng.choice([1, 2, 4, 8, 0.5, 1 / 3], (u, o)))
        cnt = lp_rng.integers(1, 5, u).astype(float)
        world = float(lp_rng.uniform(0.2, 1.0) * (cnt * np.where(np.isfinite(G), R, 0).max(axis=1)).sum() + 1e-3)
        got, want = TightBound.lp_value(G, R, cnt, world), lp_exact(G, R, cnt, world)
        assert (got == want == np.inf) or abs(got - want) <= 1e-9 * abs(want), (got, want)
        if np.isfinite(want):
            lp_gap = max(lp_gap, abs(got - want) / abs(want))
            binding += want > (cnt * np.where(np.isfinite(G), G, np.inf).min(axis=1)).sum() * (1 + 1e-9)
    print(f"(c') 500 random LPs: cutting-plane dual = exact primal (max relative difference {lp_gap:.1e}; "
          f"the rank limit binds in {binding})", flush=True)
    worst = {"mid/tight": 1.0, "exact": 0.0, "f/time": 0.0, "sum g/(k time)": 0.0, "tau/time": 0.0,
             "per-rank/mid": 0.0}
    per_rank_n = 0
    slack: dict[str, float] = {}
    n = raised = exact_n = 0
    for world in worlds:
        for scenario in SCENARIOS:
            for dist in DISTRIBUTIONS:
                tps = max(SCENARIOS[scenario].tokens_per_step * world // 32, 1)
                ctx, steps = build_cell(scenario, dist, world, tps, 4)
                steps = steps[:real_steps]
                for _ in range(small_steps):
                    ids = rng.choice(len(ctx.sizes), size=int(rng.integers(2, 11)), replace=False)
                    steps.append(Step(len(steps), tuple(int(i) for i in ids)))
                tb = TightBound(ctx)
                mids, ranks = [], []
                for s in steps:
                    off, tight, mid = official_compute(ctx, s), tb.compute(s), tb.midpoint(s, raw=True)
                    assert tight >= off * (1 - 1e-12), (scenario, dist, world, s.index, tight, off)
                    assert mid >= tight * (1 - 1e-9), (scenario, dist, world, s.index, mid, tight)
                    worst["mid/tight"] = max(worst["mid/tight"], mid / tight)
                    raised += mid > tight * (1 + 1e-9)
                    if len({ctx.sizes[i] for i in s.sample_ids}) <= 64:  # (c): the exact scan is slow
                        scan, exact = tb.midpoint(s, scan=True, raw=True), midpoint_exact(tb, s)
                        for x in (mid, scan):
                            assert abs(x - exact) <= 1e-9 * exact, (scenario, dist, world, s.index, x, exact)
                        worst["exact"] = max(worst["exact"], abs(mid - exact) / exact)
                        exact_n += 1
                    mids.append(tb.midpoint_step(s))
                    ranks.append(tb.per_rank_step(s) if scenario == "video" else 0.0)
                    if scenario == "video":
                        worst["per-rank/mid"] = max(worst["per-rank/mid"], ranks[-1] / mids[-1])
                        per_rank_n += 1
                    n += 1
                for name in ("dcp", "bucket", "packed"):
                    planner = make_planner(name, ctx, steps, score=step_seconds(ctx))
                    for s, mid, pr in zip(steps, mids, ranks):
                        plan = planner.plan(s)
                        plan.validate(world)
                        sim = simulate([plan], ctx).total_time
                        assert mid <= sim * (1 + 1e-9), (name, scenario, dist, world, s.index, mid, sim)
                        assert pr <= sim * (1 + 1e-9), (name, scenario, dist, world, s.index, pr, sim)
                        slack[name] = min(slack.get(name, np.inf), sim / max(mid, pr))
                        if scenario == "video":
                            worst["tau/time"] = max(worst["tau/time"], tau_ratio(tb, plan))
                        for mb in plan.micro_batches():
                            k, d = mb.layout.sp, ctx.mb_time(mb.sample_ids, mb.layout)
                            c = ctx.sp_sizes.index(k)
                            fg = [tb.sample(ctx.sizes[i]) for i in mb.sample_ids]
                            worst["f/time"] = max(worst["f/time"], max(x[0][c] for x in fg) / d)
                            worst["sum g/(k time)"] = max(worst["sum g/(k time)"], sum(x[1][c] for x in fg) / (k * d))
                print(f"world {world:3d} {scenario:5s} {dist:8s}: {len(steps)} steps ok "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"{n} steps: (a) midpoint >= tight >= official compute on all; midpoint > tight on {raised}, "
          f"midpoint / tight up to {worst['mid/tight']:.3f}; (b) simulated plan / the larger of the midpoint and "
          f"(video) per-rank bounds >= "
          + ", ".join(f"{k} {v:.4f}" for k, v in slack.items())
          + f"; (c) on {exact_n} steps, midpoint vs exact LP scan: max relative difference {worst['exact']:.1e}; "
          f"assumptions over the planned micro-batches: max f_k / time {worst['f/time']:.4f}, "
          f"max sum g_k / (k time) {worst['sum g/(k time)']:.4f}; (d) per-rank bound on {per_rank_n} video steps, "
          f"up to {worst['per-rank/mid']:.3f} x the midpoint bound, never above a simulated plan; planned video "
          f"micro-batches: max tau_k(m) / time {worst['tau/time']:.4f} (<= 1: the per-rank bound's assumption holds)",
          flush=True)
    return 0


def tau_ratio(tb: TightBound, plan) -> float:
    """The largest tau_k(m) (the per-rank bound's time for the micro-batch's shape, degree and
    size) / the micro-batch's time over a plan's micro-batches: <= 1 where the bound's
    assumption holds."""
    ctx, worst = tb.ctx, 0.0
    for mb in plan.micro_batches():
        assert len({ctx.bucket_of[i] for i in mb.sample_ids}) == 1, "a video micro-batch mixes shapes"
        m, k = len(mb.sample_ids), mb.layout.sp
        sizes = [z for z in {ctx.sizes[i] for i in mb.sample_ids} if ctx.max_mbs(z, k, "pac", cap=m) >= m]
        assert sizes, "a planned micro-batch holds more copies than fit"
        worst = max(worst, tb.copies_time(sizes, m, k) / ctx.mb_time(mb.sample_ids, mb.layout))
    return worst


def plan_check(ctx: PlanContext, steps: list[Step], tb: TightBound, policies: list[str]) -> dict:
    """Plans `steps` with each policy and asserts that no simulated step is below its midpoint
    or (video) per-rank bound; per policy (smallest simulated step / the larger bound,
    simulated epoch, largest sum g_k / (k time) over its micro-batches, video: largest
    tau_k(m) / time, else None)."""
    from dcparallel.plan.policies import make_planner
    from dcparallel.sim.replay import simulate, step_seconds

    out = {}
    for name in policies:
        if name == "packed" and ctx.cluster.world_size > 1024:
            continue
        planner = make_planner(name, ctx, steps, score=step_seconds(ctx))
        worst, total, work = np.inf, 0.0, 0.0
        video = ctx.model.kind == "video"
        tau = 0.0 if video else None
        for s in steps:
            plan = planner.plan(s)
            plan.validate(ctx.cluster.world_size)
            sim = simulate([plan], ctx).total_time
            mid = tb.best_step(s)
            assert mid <= sim * (1 + 1e-9), (name, s.index, mid, sim)
            worst, total = min(worst, sim / mid), total + sim
            if video:
                tau = max(tau, tau_ratio(tb, plan))
            for mb in plan.micro_batches():
                k, d = mb.layout.sp, ctx.mb_time(mb.sample_ids, mb.layout)
                c = ctx.sp_sizes.index(k)
                work = max(work, sum(tb.sample(ctx.sizes[i])[1][c] for i in mb.sample_ids) / (k * d))
        out[name] = (worst, total, work, tau)
    return out


def main() -> int:
    """For the scale report's cells where `dcp` is below `--below` of the official bound: the
    official, the tight and the midpoint bounds, and every policy's efficiency against them.

        PYTHONPATH=. .venv/bin/python benchmarks/tight_bound.py benchmarks/sim-scale_cpu_DATE.json OUT.md
        PYTHONPATH=. .venv/bin/python benchmarks/tight_bound.py --check
    """
    import argparse
    import json
    import platform
    import sys
    import time
    from pathlib import Path

    from dcparallel.plan.bounds import LowerBound

    ap = argparse.ArgumentParser()
    ap.add_argument("scale_json", type=Path, nargs="?")
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--below", type=float, default=0.95)
    ap.add_argument("--min-steps", type=int, default=4, help="as the scale runs used (dataset size)")
    ap.add_argument("--check", action="store_true", help="run the validity checks (see `check`) instead")
    ap.add_argument("--plans", default="",
                    help="POLICY,...: also plan each cell's steps with these policies (the working tree's "
                         "planners; packed only up to 1024 GPUs, as the scale run) and check, per step, that "
                         "the midpoint bound is not above the simulated step")
    args = ap.parse_args()
    if args.check:
        return check()
    if args.scale_json is None or args.out is None:
        ap.error("give SCALE_JSON and OUT (or --check)")
    cells = [r for r in json.loads(args.scale_json.read_text())
             if "dcp" in r["policies"] and r["policies"]["dcp"]["efficiency"] < args.below]
    lines = [f"# Where the step lower bound is loose — {args.out.stem.rsplit('_', 1)[-1]}", "",
             f"Command: `PYTHONPATH=. .venv/bin/python benchmarks/tight_bound.py {' '.join(sys.argv[1:])}`; "
             f"machine: {platform.machine()} CPU ({platform.platform()}), Python {platform.python_version()}, "
             f"numpy {np.__version__}.", "",
             "The cells of the scale report where `dcp` reaches less than "
             f"{args.below} of the official bound (`plan.bounds.LowerBound`), with the tight, the midpoint "
             "and (video) the per-rank bounds of `benchmarks/tight_bound.py` (see its docstring: the tight bound "
             "limits the degrees a sample may use by the makespan; the midpoint bound also requires the "
             "micro-batches longer than half the makespan to fit the world side by side; the per-rank bound "
             "uses that a video micro-batch is copies of one shape, and that the micro-batches each rank runs "
             "fit in the makespan, through dual feasible functions) over the same steps (each cell's steps rebuilt "
             "as `sim_scale.run_cell` builds them, the same number as the scale run planned). Efficiency = "
             "bound / simulated epoch time (the scale report's `epoch_s`).", "",
             "`per-sample FFD s` is not a bound but a simple per-sample plan's compute time summed over the "
             "steps (`TightBound.ffd_makespan`; compute only, no gradient sync; — for steps of more than 2048 "
             "samples), for comparison with dcp's simulated epoch.", "",
             "| budget | world | scenario | dist | samples/GPU | official bound s | tight bound s | tight / official | "
             "midpoint bound s | midpoint / official | per-rank bound s | per-rank / official | dcp epoch s | "
             "per-sample FFD s | dcp eff (official) | dcp eff (tight) | dcp eff (midpoint) | dcp eff (per-rank) | "
             "dcp eff (best valid bound) | best other policy eff (official) |",
             "|" + " --- |" * 20]
    policies = [p for p in args.plans.split(",") if p]
    checked: list[str] = []
    for r in cells:
        t0 = time.perf_counter()
        ctx, steps = build_cell(r["scenario"], r["distribution"], r["world"], r["tokens_per_step"], args.min_steps)
        steps = steps[: r["steps"]]  # the scale run's --max-steps
        assert len(steps) == r["steps"], (len(steps), r["steps"])
        official = sum(LowerBound(ctx).step(s) for s in steps)
        assert abs(official - r["lower_bound_s"]) <= 1e-3 * official, (r["lower_bound_s"], official)
        tb = TightBound(ctx)
        tight = sum(tb.step(s) for s in steps)
        mid = sum(tb.midpoint_step(s) for s in steps)
        video = ctx.model.kind == "video"
        per_rank = sum(tb.per_rank_step(s) for s in steps) if video else None
        best_bound = sum(tb.best_step(s) for s in steps)
        for s in steps:  # check (a) on every step of the report's cells
            off_c, tight_c, mid_c = official_compute(ctx, s), tb.compute(s), tb.midpoint(s, raw=True)
            assert mid_c >= tight_c * (1 - 1e-9) and tight_c >= off_c * (1 - 1e-12), (s.index, off_c, tight_c, mid_c)
        for p, v in r["policies"].items():  # a bound above a real plan's epoch is a bug
            assert best_bound <= v["epoch_s"] * (1 + 1e-9), (p, best_bound, v["epoch_s"])
        if policies:
            got = plan_check(ctx, steps, tb, policies)
            checked.append(f"{r['budget']} {r['world']} {r['scenario']} {r['distribution']}: " + "; ".join(
                f"{p} {v[0]:.3f} (epoch {v[1]:.3f} s, sum g / (k time) up to {v[2]:.3f}"
                + ("" if v[3] is None else f", tau_k(m) / time up to {v[3]:.4f}") + ")" for p, v in got.items()))
            print(checked[-1], flush=True)
        # the per-sample comparison is quadratic in samples: only for steps of few samples
        ffd = sum(tb.ffd_makespan(s) for s in steps) if max(len(s.sample_ids) for s in steps) <= 2048 else None
        d = r["policies"]["dcp"]["epoch_s"]
        others = [(v["efficiency"], p) for p, v in r["policies"].items() if p != "dcp"]
        best = max(others, default=None)
        ffd_s = "—" if ffd is None else f"{ffd:.3f}"
        best_s = "—" if best is None else f"{best[0]:.3f} ({best[1]})"
        pr_s, pr_ratio, pr_eff = (("—", "—", "—") if per_rank is None else
                                  (f"{per_rank:.3f}", f"{per_rank / official:.3f}", f"{per_rank / d:.3f}"))
        lines.append(f"| {r['budget']} | {r['world']} | {r['scenario']} | {r['distribution']} | "
                     f"{r['samples_per_gpu']} | {official:.3f} | {tight:.3f} | {tight / official:.3f} | "
                     f"{mid:.3f} | {mid / official:.3f} | {pr_s} | {pr_ratio} | {d:.3f} | {ffd_s} | "
                     f"{official / d:.3f} | {tight / d:.3f} | {mid / d:.3f} | {pr_eff} | {best_bound / d:.3f} | "
                     f"{best_s} |")
        print(lines[-1], f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if checked:
        lines += ["", f"Per-step check (`--plans {args.plans}`): each cell's steps planned by the working tree's "
                  "planners and simulated step by step; the smallest simulated step / the larger of the midpoint "
                  "and (video) per-rank bounds of each policy (>= 1: no step beat them), its simulated epoch, the "
                  "largest sum of g_k over a planned micro-batch's samples / (k x its time) (<= 1 where the layout "
                  "model's work assumption holds) and, video, the largest tau_k(m) / time (<= 1 where the "
                  "per-rank bound's assumption holds):", ""] + [f"- {c}" for c in checked]
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
