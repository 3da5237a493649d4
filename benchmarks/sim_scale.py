"""The planners from 8 to 4096 GPUs: lower-bound efficiency, speedup over `bucket` and planning
time per step, for both scenarios, their three distributions and their realistic mixes
(`scenarios.MIXES`), and two step budgets.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_scale.py [--worlds 8,32,...] [--out FILE.md]
    PYTHONPATH=. .venv/bin/python benchmarks/sim_scale.py --timing-only --max-steps 2 ...  # planning ms only

"weak": the scenario's 32-GPU step budget scaled with the world; "strong": the default budget
at every world (at 1024 GPUs, about one sample per GPU or fewer). Datasets hold enough tokens
for at least `--min-steps` steps of the cell. Planning time is measured as `simulate` reports
it (`sim.run.timed_plans`): CPU time per `plan(step)`, the planner's setup (per-bucket layout
tables, the baselines' tuning) and the first step (which fills the planner's caches) apart,
the median and maximum over the later steps. `--timing-only` plans and times the steps
without the bound or the simulation (a quick re-run of the timing column on a quiet
machine). Policies too slow for a world are skipped there (`--limit POLICY=WORLD`), and a
policy whose setup and planning in a cell run past `--time-limit` seconds of CPU time is
stopped and skipped in that cell and the later cells of its world and budget.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.bounds import TIGHT_PER_GPU, LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import DISTRIBUTIONS, EPOCH_STEPS, MIXES, SCENARIOS, sample_sizes
from dcparallel.sim.replay import simulate, step_seconds
from dcparallel.sim.run import timed_plans
from dcparallel.spec import Workload

DEFAULT_LIMITS = {"dcp-intra": 128, "dcp-inter": 128, "dcp-inter-pac": 128, "dcp-v1": 128}


def cell_workload(scenario: str, dist: str, tps: int, min_steps: int) -> Workload:
    """A cell's dataset: the scenario's distribution, enough for at least `min_steps` steps of
    `tps` tokens (and the scenario's own epoch)."""
    sc = SCENARIOS[scenario]
    return Workload(
        sc.model,
        tuple(sample_sizes(scenario, dist, epoch_tokens=max(EPOCH_STEPS * sc.tokens_per_step, min_steps * tps))),
    )


class TimeLimit(Exception):
    """A policy ran past the cell's time limit."""


def _alarm(signum, frame):
    raise TimeLimit


def distributions(scenario: str, names: str) -> list[str]:
    """`names` (comma-separated) that belong to the scenario: its three distributions and the
    mixes of its kind; "all" is every one of them."""
    own = [*DISTRIBUTIONS, *(m for m, mix in MIXES.items() if mix.kind == SCENARIOS[scenario].model.kind)]
    return own if names == "all" else [d for d in names.split(",") if d in own]


def run_cell(
    scenario: str,
    dist: str,
    world: int,
    budget: str,
    policies: list[str],
    limits: dict[str, int],
    min_steps: int,
    max_steps: int | None,
    tune_steps: int | None = None,
    time_limit: float = 0.0,
    timing_only: bool = False,
    too_slow: dict[str, str] | None = None,
    per_rank_per_gpu: float = TIGHT_PER_GPU,
) -> dict:
    """One cell: every policy's efficiency, speedup and planning times. `too_slow` (policy ->
    the cell where it ran past `time_limit`) is updated, and its policies are not run.
    `per_rank_per_gpu`: the bound's per-rank LP runs on video steps of at most that many
    samples per GPU (`bounds.LowerBound`)."""
    too_slow = {} if too_slow is None else too_slow
    sc = SCENARIOS[scenario]
    tps = sc.tokens_per_step * world // 32 if budget == "weak" else sc.tokens_per_step
    tps = max(tps, 1)
    t0 = time.perf_counter()
    wl = cell_workload(scenario, dist, tps, min_steps)
    cl = sc.cluster(world)
    ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
    steps = form_steps(wl.tokens, seed=0, tokens_per_step=tps)
    if max_steps is not None:
        steps = steps[:max_steps]
    out = {
        "scenario": scenario,
        "distribution": dist,
        "world": world,
        "budget": budget,
        "tokens_per_step": tps,
        "samples": len(wl),
        "steps": len(steps),
        "samples_per_gpu": round(statistics.median(len(s.sample_ids) for s in steps) / world, 3),
        "policies": {},
        "skipped": {},
    }
    if not timing_only:
        lb = LowerBound(ctx, per_rank_per_gpu)
        bounds = [lb.step(s) for s in steps]
        simple = [lb.simple_step(s) for s in steps]
        out["lower_bound_s"], out["simple_bound_s"] = round(sum(bounds), 4), round(sum(simple), 4)
    for name in policies:
        if world > limits.get(name, 1 << 30):
            out["skipped"][name] = f"above --limit {name}={limits[name]}"
            continue
        if name in too_slow:
            out["skipped"][name] = f"past the time limit ({time_limit:.0f} CPU s) in {too_slow[name]}"
            continue
        c1 = time.process_time()
        if time_limit:
            signal.signal(signal.SIGPROF, _alarm)
            signal.setitimer(signal.ITIMER_PROF, time_limit)  # CPU time of this process
        try:
            planner = make_planner(
                name, ctx, steps if tune_steps is None else steps[:tune_steps], score=step_seconds(ctx)
            )
            setup = (time.process_time() - c1) * 1e3
            plans, timing = timed_plans(planner.plan, steps, setup)
        except TimeLimit:
            out["skipped"][name] = f"past the time limit ({time_limit:.0f} CPU s)"
            too_slow[name] = f"{budget} {world} {scenario}/{dist}"
            continue
        finally:
            if time_limit:
                signal.setitimer(signal.ITIMER_PROF, 0)
        row = {
            "plan_ms_median": round(timing.steady_median_ms, 2),
            "plan_ms_max": round(timing.steady_max_ms, 2),
            "first_step_ms": round(timing.first_step_ms, 2),
            "setup_s": round(setup / 1e3, 2),
            "settings": {k: v for k, v in planner.describe().items()},
        }
        if not timing_only:
            for p in plans:
                p.validate(world)
            used = sorted(i for p in plans for mb in p.micro_batches() for i in mb.sample_ids)
            assert used == sorted(i for s in steps for i in s.sample_ids), f"{name} is not lossless"
            sim = simulate(plans, ctx)
            assert sim.memory_violations == 0, name
            row.update({"efficiency": round(sum(bounds) / sim.total_time, 4), "epoch_s": round(sim.total_time, 4)})
        out["policies"][name] = row
    base = out["policies"].get("bucket", {}).get("epoch_s")
    for r in out["policies"].values():
        r["speedup_vs_bucket"] = round(base / r["epoch_s"], 4) if base and "epoch_s" in r else None
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for col, budget in enumerate(("weak", "strong")):
        ax_e, ax_t = axes[0][col], axes[1][col]
        for sc in SCENARIOS:
            for d in distributions(sc, "all"):
                cells = sorted(
                    (
                        r
                        for r in results
                        if r["scenario"] == sc
                        and r["distribution"] == d
                        and r["budget"] == budget
                        and "dcp" in r["policies"]
                    ),
                    key=lambda r: r["world"],
                )
                if not cells:
                    continue
                w = [r["world"] for r in cells]
                ax_e.plot(w, [r["policies"]["dcp"]["efficiency"] for r in cells], marker="o", label=f"{sc}/{d}")
                ax_t.plot(w, [r["policies"]["dcp"]["plan_ms_median"] for r in cells], marker="o", label=f"{sc}/{d}")
        for ax, yl in ((ax_e, "dcp lower-bound efficiency"), (ax_t, "dcp planning ms/step (median)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs")
            ax.set_ylabel(yl)
            ax.set_title(f"{budget} scaling")
            ax.grid(alpha=0.3)
        ax_t.set_yscale("log")
        ax_e.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(results: list[dict], args, elapsed: float) -> None:
    today = args.out.stem.rsplit("_", 1)[-1]
    plot(results, args.out.with_suffix(".png"))
    lines = [
        f"# Planner scale — simulated H200 clusters, planned on this CPU — {today}",
        "",
        f"Command: `PYTHONPATH=. .venv/bin/python benchmarks/sim_scale.py {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: {platform.machine()} CPU ({platform.processor() or 'unknown'}), 2 cores shared with other "
        f"jobs; Python {platform.python_version()}, numpy {np.__version__}. {elapsed:.0f} s in all. "
        f"Raw numbers: `{args.out.with_suffix('.json').name}`.",
        "",
        "Cost model: `AnalyticCost` (fitted to the H200 calibration; links are datasheet assumptions), "
        "8 GPUs per node. Every policy plans the same steps. Efficiency = sum of per-step lower bounds / "
        "simulated epoch time. Planning ms = CPU time of one `plan(step)` as `simulate` reports it "
        "(`sim.run.timed_plans`): median / max over the cell's steps after the first (which fills the "
        "planner's caches).",
        "",
        f"![dcp efficiency and planning time]({args.out.with_suffix('.png').name})",
        "",
    ]
    pols = args.policies.split(",")
    lines += cell_table(results, pols)
    args.out.write_text("\n".join(lines) + "\n")


def cell_table(results: list[dict], pols: list[str]) -> list[str]:
    """The markdown table of every cell: the lower bound over the simple bound alone, per policy
    its efficiency (and speedup over bucket), and dcp's planning ms (median / max)."""
    lines = [
        "| budget | world | scenario | dist | steps | samples/GPU | bound / simple bound | "
        + " | ".join(f"{p} eff (×bucket)" for p in pols)
        + " | dcp plan ms med / max |",
        "|" + " --- |" * (8 + len(pols)),
    ]
    for r in results:
        cells = []
        for p in pols:
            v = r["policies"].get(p)
            if v is None:
                cells.append("—")
            else:
                x = v["speedup_vs_bucket"]
                cells.append(f"{v['efficiency']:.3f}" + (f" (×{x:.2f})" if x else ""))
        d = r["policies"].get("dcp")
        t = "—" if d is None else f"{d['plan_ms_median']:.1f} / {d['plan_ms_max']:.1f}"
        simple = r.get("simple_bound_s")
        ratio = "—" if simple is None else f"{r['lower_bound_s'] / simple:.3f}"
        lines.append(
            f"| {r['budget']} | {r['world']} | {r['scenario']} | {r['distribution']} | {r['steps']} | "
            f"{r['samples_per_gpu']} | {ratio} | " + " | ".join(cells) + f" | {t} |"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    today = dt.date.today().isoformat()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / f"sim-scale_cpu_{today}.md")
    ap.add_argument("--worlds", default="8,32,128,512,1024,2048,4096")
    ap.add_argument("--scenarios", default="text,video")
    ap.add_argument(
        "--distributions",
        default="all",
        help="comma-separated, or all: each scenario's three distributions and its mixes",
    )
    ap.add_argument("--budgets", default="weak,strong")
    ap.add_argument("--policies", default="bucket,packed,dcp-inter-pac,dcp-v1,dcp")
    ap.add_argument("--limit", action="append", default=[], help="POLICY=WORLD: skip POLICY above WORLD GPUs")
    ap.add_argument("--min-steps", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=None, help="plan at most this many steps per cell")
    ap.add_argument(
        "--tune-steps",
        type=int,
        default=None,
        help="the static baselines tune their SP degree and recompute on this many first steps only",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="CPU seconds a policy may take in a cell, setup and steps; past them it is skipped",
    )
    ap.add_argument("--timing-only", action="store_true", help="plan and time only: no bound, no simulation")
    ap.add_argument(
        "--per-rank-per-gpu",
        type=float,
        default=TIGHT_PER_GPU,
        help="the bound's per-rank LP on video steps of at most this many samples per GPU (up to ~10 s a step)",
    )
    args = ap.parse_args()
    limits = dict(DEFAULT_LIMITS)
    if args.timing_only:  # no epoch times: the table and plot need them
        args.out = args.out.with_name(args.out.stem + "-timing.md")
    for item in args.limit:
        k, v = item.split("=")
        limits[k] = int(v)
    results = []
    t0 = time.perf_counter()
    for budget in args.budgets.split(","):
        for world in [int(w) for w in args.worlds.split(",")]:
            too_slow: dict[str, str] = {}  # a policy past the time limit is not run again at this world
            for sc in args.scenarios.split(","):
                for d in distributions(sc, args.distributions):
                    r = run_cell(
                        sc,
                        d,
                        world,
                        budget,
                        args.policies.split(","),
                        limits,
                        args.min_steps,
                        args.max_steps,
                        args.tune_steps,
                        args.time_limit,
                        args.timing_only,
                        too_slow,
                        args.per_rank_per_gpu,
                    )
                    pols = "; ".join(
                        f"{n} eff {p.get('efficiency')} x{p.get('speedup_vs_bucket')} ms "
                        f"{p.get('plan_ms_median')}/{p.get('plan_ms_max')}"
                        for n, p in r["policies"].items()
                    )
                    print(
                        f"{budget:6s} {world:5d} {sc:5s} {d:13s} steps {r['steps']:3d} "
                        f"spg {r['samples_per_gpu']:7.2f} {pols}; skipped {r['skipped']} ({r['seconds']} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    results.append(r)
                    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
                    if not args.timing_only:
                        write_report(results, args, time.perf_counter() - t0)
    if not args.timing_only:
        write_report(results, args, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
