"""Merges `sim_scale.py` runs (their JSON files, later ones win per cell: `merge`) into one
scale report with its summary: dcp's efficiency (median, worst cell) per world, its worst
ratio to any other policy, planning ms, and the policies skipped where.

    PYTHONPATH=. .venv/bin/python benchmarks/sim_scale_report.py OUT.md RUN1.json RUN2.json ... \\
        --command "..." [--command "..."]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import numpy as np

from benchmarks.sim_scale import cell_table, cell_workload, plot

POLICY_ORDER = ["bucket", "packed", "megatron-dcp", "hbp", "flexsp", "dcp-v1", "dcp"]


def merge(cells: list[dict]) -> list[dict]:
    """One result per cell (budget, world, scenario, distribution), later runs first: a later
    run of the same steps (same count, same lower bound) adds or replaces policies (and their
    skips); a later run of other steps replaces the cell; a timing-only run (`--timing-only`:
    no bound) replaces the planning times of the policies the cell has. Speedups over
    `bucket` are recomputed."""
    out: dict[tuple, dict] = {}
    for r in cells:
        key = (r["budget"], r["world"], r["scenario"], r["distribution"])
        old = out.get(key)
        if "lower_bound_s" not in r:  # timing only
            for p, v in r["policies"].items():
                if old is not None and p in old["policies"] and old["steps"] == r["steps"]:
                    old["policies"][p].update(
                        {k: v[k] for k in ("plan_ms_median", "plan_ms_max", "first_step_ms", "setup_s")}
                    )
            continue
        if old is not None and old["steps"] == r["steps"] and old["lower_bound_s"] == r["lower_bound_s"]:
            old["policies"].update(r["policies"])
            old.setdefault("skipped", {}).update(r.get("skipped", {}))
            old["seconds"] = round(old["seconds"] + r["seconds"], 1)
        else:
            out[key] = json.loads(json.dumps(r))
    for r in out.values():
        base = r["policies"].get("bucket", {}).get("epoch_s")
        for v in r["policies"].values():
            v["speedup_vs_bucket"] = round(base / v["epoch_s"], 4) if base else None
    return list(out.values())


def simple_line(results: list[dict]) -> list[str]:
    """The summary's line on dcp's efficiency against the simple bound alone (if recorded)."""
    cells = [r for r in results if "dcp" in r["policies"] and "simple_bound_s" in r]
    if not cells:
        return []
    effs = [r["simple_bound_s"] / r["policies"]["dcp"]["epoch_s"] for r in cells]
    raised = [r for r in cells if r["lower_bound_s"] > r["simple_bound_s"] * (1 + 1e-9)]
    return [
        f"- against the simple bound alone (`LowerBound.simple`: no midpoint or per-rank bound) over "
        f"{len(cells)} cells: median {statistics.median(effs):.3f}, worst {min(effs):.3f}; below 0.95: "
        f"{sum(e < 0.95 for e in effs)}, below 0.90: {sum(e < 0.90 for e in effs)}. The midpoint or per-rank "
        f"bound is above the simple one in {len(raised)} cells (by up to "
        f"{max((r['lower_bound_s'] / r['simple_bound_s'] for r in raised), default=1.0):.3f}x)."
    ]


def rebound(results: list[dict], min_steps: int = 4, kind: str | None = None) -> None:
    """Each cell's lower bound recomputed with the working tree's `LowerBound`, in place, from
    the cell's steps rebuilt as `sim_scale.run_cell` builds them; the efficiencies follow. The
    simple bound is recomputed too (`simple_bound_s`); it is never above the one a run recorded."""
    from tqdm import tqdm

    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.plan.bounds import LowerBound
    from dcparallel.plan.context import PlanContext
    from dcparallel.plan.steps import form_steps
    from dcparallel.scenarios import SCENARIOS

    for r in tqdm(
        [r for r in results if kind is None or SCENARIOS[r["scenario"]].model.kind == kind], desc="bounds", unit="cell"
    ):
        recorded = r.get("simple_bound_s", r["lower_bound_s"])
        sc = SCENARIOS[r["scenario"]]
        tps = r["tokens_per_step"]
        wl = cell_workload(r["scenario"], r["distribution"], tps, min_steps)
        assert len(wl) == r["samples"], (r["samples"], len(wl))
        steps = form_steps(wl.tokens, seed=0, tokens_per_step=tps)[: r["steps"]]
        assert len(steps) == r["steps"], (len(steps), r["steps"])
        cl = sc.cluster(r["world"])
        lb = LowerBound(PlanContext(wl, AnalyticCost(sc.model, cl), cl))
        simple = sum(lb.simple_step(s) for s in steps)
        # a sample's fewest GPU-seconds are taken over every micro-batch size, a superset of the
        # sizes a recorded run may have priced: the bound can only come out lower
        assert simple <= recorded * (1 + 1e-4), (r["budget"], r["world"], simple, recorded)
        r["simple_bound_s"] = round(simple, 4)
        r["lower_bound_s"] = round(lb.epoch(steps), 4)
        for v in r["policies"].values():
            v["efficiency"] = round(r["lower_bound_s"] / v["epoch_s"], 4)


def fmt_ms(v: dict | None) -> str:
    """A policy's planning ms in a cell: steady-state median / max (CPU), or — if not run."""
    return "—" if v is None else f"{v['plan_ms_median']:.1f} / {v['plan_ms_max']:.1f}"


def timing_table(results: list[dict], pols: list[str]) -> list[str]:
    """Per cell and policy, planning CPU ms per step (steady-state median / max), and dcp's
    first step and setup."""
    lines = [
        "| budget | world | scenario | dist | "
        + " | ".join(f"{p} ms med / max" for p in pols)
        + " | dcp first step ms | dcp setup s |",
        "|" + " --- |" * (6 + len(pols)),
    ]
    for r in results:
        d = r["policies"].get("dcp")
        lines.append(
            f"| {r['budget']} | {r['world']} | {r['scenario']} | {r['distribution']} | "
            + " | ".join(fmt_ms(r["policies"].get(p)) for p in pols)
            + (
                " | — | — |"
                if d is None
                else f" | {d.get('first_step_ms', float('nan')):.1f} | {d.get('setup_s', float('nan')):.1f} |"
            )
        )
    return lines


def summary(results: list[dict], worlds: list[int]) -> list[str]:
    """dcp's efficiency overall and per world against the targets, its worst ratio to every other
    policy, and planning ms (median of the cells' medians, worst cell, worst step) per world."""
    out = []

    def cell(r):
        return f"{r['budget']} {r['world']} {r['scenario']}/{r['distribution']}"

    have = [r for r in results if "dcp" in r["policies"] and "efficiency" in r["policies"]["dcp"]]
    for w in [None, *worlds]:
        cells = [r for r in have if w is None or r["world"] == w]
        if not cells:
            continue
        effs = [r["policies"]["dcp"]["efficiency"] for r in cells]
        worst = min(cells, key=lambda r: r["policies"]["dcp"]["efficiency"])
        ratios = sorted(
            (
                (r["policies"]["dcp"]["epoch_s"] / v["epoch_s"], r, p)
                for r in cells
                for p, v in r["policies"].items()
                if p != "dcp" and "epoch_s" in v
            ),
            key=lambda x: -x[0],
        )
        ms = [r["policies"]["dcp"]["plan_ms_median"] for r in cells]
        slower = [f"{cell(r)} vs {p} ({x:.4f})" for x, r, p in ratios if x > 1.01]
        vs = (
            f"Worst dcp / other epoch time **{ratios[0][0]:.4f}** ({cell(ratios[0][1])} vs {ratios[0][2]}); more "
            "than 1% slower than some policy: " + ("; ".join(slower) if slower else "none") + "."
            if ratios
            else "No other policy ran in these cells."
        )
        out.append(
            f"- {'all worlds' if w is None else f'{w} GPUs'} ({len(cells)} cells): `dcp` efficiency median "
            f"**{statistics.median(effs):.3f}**, worst **{min(effs):.3f}** ({cell(worst)}); below 0.95: "
            f"{sum(e < 0.95 for e in effs)}, below 0.90: {sum(e < 0.90 for e in effs)}. {vs} Planning (CPU "
            f"ms, steady state): median over cells {statistics.median(ms):.1f}, worst cell "
            f"{max(ms):.1f}, worst step {max(r['policies']['dcp']['plan_ms_max'] for r in cells):.1f}."
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--command", action="append", default=[])
    ap.add_argument("--note", action="append", default=[], help="a paragraph (markdown) after the setup")
    ap.add_argument("--notes-file", type=Path, default=None, help="paragraphs (markdown) after the setup")
    ap.add_argument(
        "--rebound",
        action="store_true",
        help="recompute every cell's lower bound with the working tree's LowerBound (`rebound`)",
    )
    ap.add_argument("--rebound-kind", default=None, help="with --rebound: only the cells of this model kind")
    ap.add_argument("--worlds", default=None, help="comma-separated: keep only the cells of these worlds")
    ap.add_argument("--min-steps", type=int, default=4, help="with --rebound: the runs' --min-steps")
    ap.add_argument("--load", default="12-23", help="the machine's load average during the runs, as reported")
    args = ap.parse_args()
    from benchmarks.sim_scale import distributions

    results = merge([r for p in args.runs for r in json.loads(p.read_text())])
    if args.worlds:
        results = [r for r in results if str(r["world"]) in args.worlds.split(",")]
    if args.rebound:
        rebound(results, min_steps=args.min_steps, kind=args.rebound_kind)
    results.sort(
        key=lambda r: (
            r["budget"] != "weak",
            r["world"],
            r["scenario"],
            distributions(r["scenario"], "all").index(r["distribution"]),
        )
    )
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))
    pols = [p for p in POLICY_ORDER if any(p in r["policies"] for r in results)]
    worlds = sorted({r["world"] for r in results})
    have = {(r["budget"], r["world"], r["scenario"], r["distribution"]) for r in results}
    # at 32 GPUs the strong budget is the weak one: those cells are listed once, as weak
    grid = [
        (b, w, sc, d)
        for b in ("weak", "strong")
        for w in worlds
        for sc in ("text", "video")
        for d in distributions(sc, "all")
        if not (b == "strong" and w == 32)
    ]
    missing = [f"{b} {w} {sc}/{d}" for b, w, sc, d in grid if (b, w, sc, d) not in have]
    skipped: dict[str, list[str]] = {}
    for r in results:
        for p, why in r.get("skipped", {}).items():
            if p not in r["policies"]:
                skipped.setdefault(f"`{p}`: {why}", []).append(
                    f"{r['budget']} {r['world']} {r['scenario']}/{r['distribution']}"
                )
    import scipy

    lines = [
        f"# Planner scale — every policy on the scenarios and the realistic mixes, {worlds[0]} to "
        f"{worlds[-1]} GPUs (simulated H200, planned on this CPU) — {args.out.stem.rsplit('_', 1)[-1]}",
        "",
        "Commands (each writes a JSON file; this report merges them, later runs winning per cell and policy):",
        "",
    ]
    lines += [f"    {c}" for c in args.command]
    lines += [
        "",
        f"    PYTHONPATH=. .venv/bin/python benchmarks/sim_scale_report.py {args.out} "
        + " ".join(str(p) for p in args.runs)
        + (f" --notes-file {args.notes_file}" if args.notes_file else "")
        + (" --rebound" if args.rebound else "")
        + (f" --rebound-kind {args.rebound_kind}" if args.rebound_kind else "")
        + (f" --worlds {args.worlds}" if args.worlds else "")
        + (f" --min-steps {args.min_steps}" if args.rebound else "")
        + f" --load {args.load} --command ...",
        "",
        f"Machine: {platform.machine()} CPU ({platform.platform()}), 2 cores shared with about seven other "
        f"jobs (load average {args.load} during the runs); Python {platform.python_version()}, numpy "
        f"{np.__version__}, scipy {scipy.__version__}. Raw numbers: `{args.out.with_suffix('.json').name}`.",
        "",
        "Cost model: `AnalyticCost` fitted to the H200 calibration, 8 GPUs per node, NVLink / InfiniBand "
        "from datasheets (assumptions). Every policy plans the same steps (shared step former). "
        "`weak` = the scenario's 32-GPU step budget × world / 32; `strong` = the 32-GPU budget at every "
        "world. Distributions: the scenarios' `short`, `balanced`, `long` and the realistic mixes "
        "(`scenarios.MIXES`: `video-mix`, `video-wide`, `sft-long`, `pretrain-long`, and those of "
        "`dcparallel/mixes.py`: `image-buckets`, `opensora-stage3`, `long-cpt`, `sft-chat-long`). "
        "Efficiency = Σ per-step lower bound (`plan.bounds.LowerBound`, with its shape part on video "
        "steps) / simulated epoch time over the cell's steps; `×` = speedup "
        "over tuned `bucket`. `megatron-dcp` and `hbp` are reproductions from the published descriptions "
        "(`dcparallel/plan/research/peers.py`); `flexsp` reproduces FlexSP's optimal assignment (a MILP per step, "
        "`dcparallel/plan/research/flexsp.py`).",
        "",
        "Planning ms are measured as `simulate` reports them (`sim.run.timed_plans`): CPU time "
        "(`time.process_time`) of one `plan(step)`, the setup (building and tuning the planner) and the "
        "first step (which fills the planner's caches) apart, median / max over the later steps. **On this "
        "loaded machine they are inflated** (CPU time counts the cache and memory contention of the other "
        "jobs); `sim_scale.py --timing-only --max-steps 3` re-measures this column alone on a quiet "
        "machine.",
        "",
    ]
    notes = [*args.note, *([args.notes_file.read_text().strip()] if args.notes_file else [])]
    lines += [x for n in notes for x in (n, "")]
    lines += [
        "## Summary",
        "",
        f"- cells: {len(results)} of {len(grid)}; missing: " + (", ".join(missing) if missing else "none") + ".",
        *summary(results, worlds),
    ]
    for why, cells in skipped.items():
        lines.append(f"- not run, {why}: {', '.join(cells)}.")
    lines += [
        "",
        f"![dcp efficiency and planning time]({args.out.with_suffix('.png').name})",
        "",
        "## Efficiency (× bucket)",
        "",
        *cell_table(results, pols),
        "",
        "## Planning CPU ms per step (steady state, median / max)",
        "",
        *timing_table(results, pols),
        "",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
