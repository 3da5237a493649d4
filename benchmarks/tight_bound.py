"""The parts of the step lower bound (`plan.bounds.LowerBound`), apart: where the simple bound
is loose (few samples per GPU), and checks that each part is valid.

`plan.bounds` defines the layout model, its assumptions (A1: a sample does not run faster in
company; A2: no sample costs fewer GPU-seconds than in its best micro-batch of copies) and the
three bounds the library takes the largest of: the simple bound, max(sum_s g(s) / world,
max_s f(s)); the midpoint bound (the micro-batches longer than T / 2 all run at T / 2, so
their ranks fit the world: an LP over the samples' degrees, solved through its dual); and, for
video, the per-rank bound (the micro-batches each rank runs fit in T, counted through dual
feasible functions of their exact times; neither A1 nor A2). The library computes the last two
only for steps of at most `plan.bounds.TIGHT_PER_GPU` samples per GPU; this script computes
them on every step it is given.

Here also the tight bound (`TightBound.tight`), between the simple and midpoint bounds: a
step that finishes by T cannot run s at a degree k where s alone takes longer than T (A1), so

    bound_T(step) = min T such that T >= max_s f(s) and sum_s g_T(s) <= world * T,
    g_T(s) = min over degrees k with f_k(s) <= T of g_k(s).

With lambda = 0 the midpoint LP's work test is the tight bound's, so the midpoint bound is never
below it (but for ~1e-12 of rounding: `midpoint_step` takes the larger).

Not the midpoint bound as first specified, over layouts (k, m) with the copies time t_o <= T
and r_o = k / m when t_o > T/2: real plans mix samples of different lengths in one micro-batch,
whose time is not that of copies of either. E.g. (text, 16 GPUs) samples of 67932 and 43676
tokens in one micro-batch at sp 16 take 1.612 s, but two copies of the longer one exceed that
time, so that version put the step's bound at 1.654 s, above the 1.613 s of the plan `packed`
made (`--check` found it). It gave bounds 4-6% above the tight bound at strong 512 text; the
valid one, 0.2-0.6%.

    PYTHONPATH=. .venv/bin/python benchmarks/tight_bound.py --check   # validity checks
"""

from __future__ import annotations

import numpy as np

from dcparallel.plan.bounds import LowerBound, breakpoints, interval, lp_value
from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import Step


class TightBound(LowerBound):
    """The library's bound with its parts apart (each with the exposed sync), the tight bound,
    and the midpoint bound's slower variants for the checks."""

    def tight(self, step: Step) -> float:
        """The tight compute bound: the least T >= max f with sum_s g_T(s) <= world * T."""
        f, g, cnt = self._tables(step)
        world = self.world
        fmax = float(f.min(axis=1).max())
        cands = np.unique(f[np.isfinite(f)])
        cands = np.concatenate([[fmax], cands[cands > fmax]])
        best = np.inf
        for T in cands:  # the work needed is constant between breakpoints and falls as T grows
            work = float((np.where(f <= T * (1 + 1e-12), g, np.inf).min(axis=1) * cnt).sum())
            got = max(T, work / world)
            best = min(best, got)
            if work / world <= T:
                break
        return best

    def midpoint_raw(self, step: Step, scan: bool = False, exact: bool = False) -> float:
        """The midpoint compute bound (`LowerBound.midpoint`); `scan` tests every interval in
        order instead of binary search, `exact` scans with the plain `interval_naive` and
        `lp_exact` instead."""
        if not (scan or exact):
            return self.midpoint(step)
        f, g, cnt = self._tables(step)
        sp = np.asarray(self.ctx.sp_sizes, dtype=float)
        world = float(self.world)
        b = breakpoints(f)
        ends = np.append(b[1:], np.inf)
        lp, iv = (lp_exact, interval_naive) if exact else (lp_value, interval)
        for j in range(len(b)):
            v = lp(*iv(f, g, cnt, sp, float(b[j]), float(ends[j])), cnt, world)
            if v <= world * ends[j]:
                return max(float(b[j]), v * (1 - 1e-12) / world)
        raise AssertionError("the last interval is always feasible")

    def tight_step(self, step: Step) -> float:
        return self.with_sync(self.tight(step))

    def midpoint_step(self, step: Step) -> float:
        """The midpoint bound, or the tight bound where rounding leaves it a hair (~1e-12) below."""
        return self.with_sync(max(self.midpoint(step), self.tight(step)))

    def per_rank_step(self, step: Step) -> float:
        return self.with_sync(self.per_rank(step)) if self.ctx.model.kind == "video" else 0.0

    def best_step(self, step: Step) -> float:
        """The larger of the midpoint and (video) per-rank bounds of the step, sync included,
        whatever the step's samples per GPU."""
        return max(self.midpoint_step(step), self.per_rank_step(step))

    def ffd_makespan(self, step: Step) -> float:
        """Not a bound: the makespan of a simple per-sample plan, for comparison — for a target
        T every sample runs alone at the narrowest degree that finishes it within T, the samples
        of one degree are packed first-fit decreasing into groups of capacity T, and the
        smallest T whose groups fit the world wins (one phase, no micro-batches of several
        samples, no idle ranks reused)."""
        ctx = self.ctx
        sp = np.asarray(ctx.sp_sizes)
        f = np.array([self.degrees(ctx.sizes[i])[0] for i in step.sample_ids])
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


def random_lp(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """A random instance (G, R, cnt, world) of the midpoint bound's LP (`plan.bounds.lp_value`):
    up to 29 sizes of up to 6 options, some unusable, every size with one usable; a rank limit
    that often binds."""
    u, o = int(rng.integers(1, 30)), int(rng.integers(1, 7))
    G = rng.uniform(1, 10, (u, o)) * np.where(rng.random((u, o)) < 0.15, np.inf, 1.0)
    G[np.arange(u), rng.integers(0, o, u)] = rng.uniform(1, 10, u)  # every row has an option
    R = np.where(rng.random((u, o)) < 0.4, 0.0, rng.choice([1, 2, 4, 8, 0.5, 1 / 3], (u, o)))
    cnt = rng.integers(1, 5, u).astype(float)
    world = float(rng.uniform(0.2, 1.0) * (cnt * np.where(np.isfinite(G), R, 0).max(axis=1)).sum() + 1e-3)
    return G, R, cnt, world


def build_cell(scenario: str, dist: str, world: int, tps: int, min_steps: int):
    """The context and steps of a cell as `sim_scale.run_cell` builds them (all its steps)."""
    from benchmarks.sim_scale import cell_workload
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.plan.steps import form_steps
    from dcparallel.scenarios import SCENARIOS

    sc = SCENARIOS[scenario]
    wl = cell_workload(scenario, dist, tps, min_steps)
    cl = sc.cluster(world)
    ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
    return ctx, form_steps(wl.tokens, seed=0, tokens_per_step=tps)


def check(worlds=(8, 16), real_steps: int = 2, small_steps: int = 6, seed: int = 0) -> int:
    """The validity checks, as asserts: on the weak cells' contexts at `worlds` (both scenarios,
    every distribution), for their first `real_steps` steps and `small_steps` random steps of
    2-10 samples:
      (a) midpoint bound (the LP's answer alone, to 1e-9) >= tight bound >= the simple bound's
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
        G, R, cnt, world = random_lp(lp_rng)
        got, want = lp_value(G, R, cnt, world), lp_exact(G, R, cnt, world)
        assert (got == want == np.inf) or abs(got - want) <= 1e-9 * abs(want), (got, want)
        if np.isfinite(want):
            lp_gap = max(lp_gap, abs(got - want) / abs(want))
            binding += want > (cnt * np.where(np.isfinite(G), G, np.inf).min(axis=1)).sum() * (1 + 1e-9)
    print(
        f"(c') 500 random LPs: cutting-plane dual = exact primal (max relative difference {lp_gap:.1e}; "
        f"the rank limit binds in {binding})",
        flush=True,
    )
    worst = {"mid/tight": 1.0, "exact": 0.0, "f/time": 0.0, "sum g/(k time)": 0.0, "tau/time": 0.0, "per-rank/mid": 0.0}
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
                    off, tight, mid = tb.simple(s), tb.tight(s), tb.midpoint_raw(s)
                    assert tight >= off * (1 - 1e-12), (scenario, dist, world, s.index, tight, off)
                    assert mid >= tight * (1 - 1e-9), (scenario, dist, world, s.index, mid, tight)
                    worst["mid/tight"] = max(worst["mid/tight"], mid / tight)
                    raised += mid > tight * (1 + 1e-9)
                    if len({ctx.sizes[i] for i in s.sample_ids}) <= 64:  # (c): the exact scan is slow
                        scan, exact = tb.midpoint_raw(s, scan=True), tb.midpoint_raw(s, exact=True)
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
                            fg = [tb.degrees(ctx.sizes[i]) for i in mb.sample_ids]
                            worst["f/time"] = max(worst["f/time"], max(x[0][c] for x in fg) / d)
                            worst["sum g/(k time)"] = max(worst["sum g/(k time)"], sum(x[1][c] for x in fg) / (k * d))
                print(
                    f"world {world:3d} {scenario:5s} {dist:8s}: {len(steps)} steps ok "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    print(
        f"{n} steps: (a) midpoint >= tight >= simple compute on all; midpoint > tight on {raised}, "
        f"midpoint / tight up to {worst['mid/tight']:.3f}; (b) simulated plan / the larger of the midpoint and "
        f"(video) per-rank bounds >= "
        + ", ".join(f"{k} {v:.4f}" for k, v in slack.items())
        + f"; (c) on {exact_n} steps, midpoint vs exact LP scan: max relative difference {worst['exact']:.1e}; "
        f"assumptions over the planned micro-batches: max f_k / time {worst['f/time']:.4f}, "
        f"max sum g_k / (k time) {worst['sum g/(k time)']:.4f}; (d) per-rank bound on {per_rank_n} video steps, "
        f"up to {worst['per-rank/mid']:.3f} x the midpoint bound, never above a simulated plan; planned video "
        f"micro-batches: max tau_k(m) / time {worst['tau/time']:.4f} (<= 1: the per-rank bound's assumption holds)",
        flush=True,
    )
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
                work = max(work, sum(tb.degrees(ctx.sizes[i])[1][c] for i in mb.sample_ids) / (k * d))
        out[name] = (worst, total, work, tau)
    return out


def main() -> int:
    """For the scale report's cells where `dcp` is below `--below` of the simple bound: the
    simple, the tight, the midpoint and (video) the per-rank bounds, and `dcp`'s efficiency
    against each.

        PYTHONPATH=. .venv/bin/python benchmarks/tight_bound.py benchmarks/sim-scale_cpu_DATE.json OUT.md
        PYTHONPATH=. .venv/bin/python benchmarks/tight_bound.py --check
    """
    import argparse
    import json
    import platform
    import sys
    import time
    from pathlib import Path

    ap = argparse.ArgumentParser()
    ap.add_argument("scale_json", type=Path, nargs="?")
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--below", type=float, default=0.95)
    ap.add_argument("--min-steps", type=int, default=4, help="as the scale runs used (dataset size)")
    ap.add_argument("--check", action="store_true", help="run the validity checks (see `check`) instead")
    ap.add_argument(
        "--plans",
        default="",
        help="POLICY,...: also plan each cell's steps with these policies (the working tree's "
        "planners; packed only up to 1024 GPUs, as the scale run) and check, per step, that "
        "the midpoint bound is not above the simulated step",
    )
    args = ap.parse_args()
    if args.check:
        return check()
    if args.scale_json is None or args.out is None:
        ap.error("give SCALE_JSON and OUT (or --check)")

    def simple_s(r: dict) -> float:  # reports before the bounds were merged hold only the simple one
        return r.get("simple_bound_s", r["lower_bound_s"])

    cells = [
        r
        for r in json.loads(args.scale_json.read_text())
        if "dcp" in r["policies"] and simple_s(r) / r["policies"]["dcp"]["epoch_s"] < args.below
    ]
    lines = [
        f"# Where the step lower bound is loose — {args.out.stem.rsplit('_', 1)[-1]}",
        "",
        f"Command: `PYTHONPATH=. .venv/bin/python benchmarks/tight_bound.py {' '.join(sys.argv[1:])}`; "
        f"machine: {platform.machine()} CPU ({platform.platform()}), Python {platform.python_version()}, "
        f"numpy {np.__version__}.",
        "",
        "The cells of the scale report where `dcp` reaches less than "
        f"{args.below} of the simple bound (`plan.bounds.LowerBound.simple`), with the tight, the midpoint "
        "and (video) the per-rank bounds of `benchmarks/tight_bound.py` (see its docstring: the tight bound "
        "limits the degrees a sample may use by the makespan; the midpoint bound also requires the "
        "micro-batches longer than half the makespan to fit the world side by side; the per-rank bound "
        "uses that a video micro-batch is copies of one shape, and that the micro-batches each rank runs "
        "fit in the makespan, through dual feasible functions) over the same steps (each cell's steps rebuilt "
        "as `sim_scale.run_cell` builds them, the same number as the scale run planned). Efficiency = "
        "bound / simulated epoch time (the scale report's `epoch_s`).",
        "",
        "`per-sample FFD s` is not a bound but a simple per-sample plan's compute time summed over the "
        "steps (`TightBound.ffd_makespan`; compute only, no gradient sync; — for steps of more than 2048 "
        "samples), for comparison with dcp's simulated epoch.",
        "",
        "| budget | world | scenario | dist | samples/GPU | simple bound s | tight bound s | tight / simple | "
        "midpoint bound s | midpoint / simple | per-rank bound s | per-rank / simple | dcp epoch s | "
        "per-sample FFD s | dcp eff (simple) | dcp eff (tight) | dcp eff (midpoint) | dcp eff (per-rank) | "
        "dcp eff (best valid bound) | best other policy eff (simple) |",
        "|" + " --- |" * 20,
    ]
    policies = [p for p in args.plans.split(",") if p]
    checked: list[str] = []
    for r in cells:
        t0 = time.perf_counter()
        ctx, steps = build_cell(r["scenario"], r["distribution"], r["world"], r["tokens_per_step"], args.min_steps)
        steps = steps[: r["steps"]]  # the scale run's --max-steps
        assert len(steps) == r["steps"], (len(steps), r["steps"])
        tb = TightBound(ctx)
        simple = sum(tb.simple_step(s) for s in steps)
        assert abs(simple - simple_s(r)) <= 1e-3 * simple, (simple_s(r), simple)
        tight = sum(tb.tight_step(s) for s in steps)
        mid = sum(tb.midpoint_step(s) for s in steps)
        video = ctx.model.kind == "video"
        per_rank = sum(tb.per_rank_step(s) for s in steps) if video else None
        best_bound = sum(tb.best_step(s) for s in steps)
        for s in steps:  # check (a) on every step of the report's cells
            off_c, tight_c, mid_c = tb.simple(s), tb.tight(s), tb.midpoint_raw(s)
            assert mid_c >= tight_c * (1 - 1e-9) and tight_c >= off_c * (1 - 1e-12), (s.index, off_c, tight_c, mid_c)
        for p, v in r["policies"].items():  # a bound above a real plan's epoch is a bug
            assert best_bound <= v["epoch_s"] * (1 + 1e-9), (p, best_bound, v["epoch_s"])
        if policies:
            got = plan_check(ctx, steps, tb, policies)
            checked.append(
                f"{r['budget']} {r['world']} {r['scenario']} {r['distribution']}: "
                + "; ".join(
                    f"{p} {v[0]:.3f} (epoch {v[1]:.3f} s, sum g / (k time) up to {v[2]:.3f}"
                    + ("" if v[3] is None else f", tau_k(m) / time up to {v[3]:.4f}")
                    + ")"
                    for p, v in got.items()
                )
            )
            print(checked[-1], flush=True)
        # the per-sample comparison is quadratic in samples: only for steps of few samples
        ffd = sum(tb.ffd_makespan(s) for s in steps) if max(len(s.sample_ids) for s in steps) <= 2048 else None
        d = r["policies"]["dcp"]["epoch_s"]
        others = [(simple / v["epoch_s"], p) for p, v in r["policies"].items() if p != "dcp"]
        best = max(others, default=None)
        ffd_s = "—" if ffd is None else f"{ffd:.3f}"
        best_s = "—" if best is None else f"{best[0]:.3f} ({best[1]})"
        pr_s, pr_ratio, pr_eff = (
            ("—", "—", "—")
            if per_rank is None
            else (f"{per_rank:.3f}", f"{per_rank / simple:.3f}", f"{per_rank / d:.3f}")
        )
        lines.append(
            f"| {r['budget']} | {r['world']} | {r['scenario']} | {r['distribution']} | "
            f"{r['samples_per_gpu']} | {simple:.3f} | {tight:.3f} | {tight / simple:.3f} | "
            f"{mid:.3f} | {mid / simple:.3f} | {pr_s} | {pr_ratio} | {d:.3f} | {ffd_s} | "
            f"{simple / d:.3f} | {tight / d:.3f} | {mid / d:.3f} | {pr_eff} | {best_bound / d:.3f} | "
            f"{best_s} |"
        )
        print(lines[-1], f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if checked:
        lines += [
            "",
            f"Per-step check (`--plans {args.plans}`): each cell's steps planned by the working tree's "
            "planners and simulated step by step; the smallest simulated step / the larger of the midpoint "
            "and (video) per-rank bounds of each policy (>= 1: no step beat them), its simulated epoch, the "
            "largest sum of g_k over a planned micro-batch's samples / (k x its time) (<= 1 where the layout "
            "model's work assumption holds) and, video, the largest tau_k(m) / time (<= 1 where the "
            "per-rank bound's assumption holds):",
            "",
        ] + [f"- {c}" for c in checked]
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
