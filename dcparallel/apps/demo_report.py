"""What the demo reports: timelines, the spread of repeats and its verdict, report.md, the table.

Per-rank timelines of the real runs, the spread of each policy's repeats and whether it leaves
the comparison meaningful, `report.md` and the printed table."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

#: the rerun advice when the timings cannot be trusted
RERUN = (
    "rerun on an idle machine, with nothing else using the cores, and more repeats: "
    "`dcparallel demo --repeats 7` (after `make demo`: `.venv/bin/dcparallel demo --repeats 7`)"
)
#: a spread of repeats (relative to their median) or a prediction error above this is large
NOISY = 0.10


def rank_timelines(real: dict, names: tuple[str, ...]) -> dict[str, dict[int, list]]:
    """Per-rank busy / idle / sync spans of each real run, on one time axis per run (steps
    laid end to end; a step lasts as long as its slowest rank)."""
    out = {}
    for name in names:
        per_rank = real["policies"][name]["rank_steps"]
        tl: dict[int, list] = {r: [] for r in range(len(per_rank))}
        t0 = 0.0
        for k in range(len(per_rank[0])):
            steps = [per_rank[r][k] for r in range(len(per_rank))]
            slowest = max(s["compute_end"] for s in steps)
            dur = max(s["end"] for s in steps)
            for r, s in enumerate(steps):
                for a, b, sp, rec in s["segs"]:
                    tl[r].append((t0 + a, t0 + b, f"busy sp={sp}" + (" recompute" if rec else "")))
                busy_end = s["segs"][-1][1] if s["segs"] else 0.0
                if slowest > busy_end:
                    tl[r].append((t0 + busy_end, t0 + slowest, "idle"))
                tl[r].append((t0 + slowest, t0 + dur, "sync"))
            t0 += dur
        out[name] = tl
    return out


def counted(walls: list[float]) -> float:
    """The wall time that counts of a policy's runs (`demo_worker.counted_run`): the median, of an
    even number the faster of the middle two."""
    return statistics.median_low(walls)


def spread(walls: list[float]) -> dict:
    """min / median / max of a policy's repeated wall times and their relative spread
    ((max - min) / median)."""
    s = sorted(walls)
    med = statistics.median(s)
    return {
        "runs": len(s),
        "min": s[0],
        "median": med,
        "max": s[-1],
        "relative": (s[-1] - s[0]) / med if med > 0 else 0.0,
    }


def trust_notes(
    walls: dict[str, list[float]],
    errors: dict[str, float] | None = None,
    pairs: tuple[tuple[str, str], ...] = (("dcp", "bucket"), ("dcp", "packed")),
) -> list[str]:
    """Plain sentences saying which comparisons the timings cannot support: a pair of policies
        whose counted (median) runs differ by less than the spread (max - min) of either's repeats, a single
        run per policy (spread unknown), a large prediction error of a policy whose own runs spread
    widely (the error may be the machine's load, not the simulator's).
        Empty when every comparison holds; the last sentence says how to rerun."""
    notes = []
    spreads = {n: spread(w) for n, w in walls.items()}
    if min(s["runs"] for s in spreads.values()) < 2:
        notes.append(
            "Each policy ran once, so the spread of its timings is unknown and no difference between "
            "policies can be told apart from noise."
        )
    else:
        for a, b in pairs:
            if a not in spreads or b not in spreads:
                continue
            gap = abs(counted(walls[a]) - counted(walls[b]))
            wide = max((a, b), key=lambda n: spreads[n]["max"] - spreads[n]["min"])
            s = spreads[wide]
            if s["max"] - s["min"] >= gap:
                notes.append(
                    f"{a} vs {b}: the difference of their median runs ({gap:.1f} s, "
                    f"{100 * gap / max(counted(walls[a]), counted(walls[b])):.0f}%) is smaller than the "
                    f"spread of {wide}'s runs ({s['min']:.1f}-{s['max']:.1f} s, {100 * s['relative']:.0f}%): "
                    f"this comparison means nothing on this machine now."
                )
        for n, e in (errors or {}).items():
            if e > NOISY and spreads[n]["relative"] > NOISY:
                rel = spreads[n]["relative"]
                notes.append(
                    f"{n}'s prediction error ({100 * e:.0f}%) comes with a {100 * rel:.0f}% "
                    f"spread of its own runs: it may measure the machine's load, not the simulator."
                )
    if notes:
        notes.append(f"To compare: {RERUN}.")
    return notes


def speed_text(s: dict) -> str:
    """The machine's speed during each policy's runs against the profile's (its reference run,
    `profile.drift`) and the predictions priced at the runs' speed."""
    walls = {n: v["wall_s"] for n, v in s["real"]["policies"].items()}
    runs = ", ".join(
        f"{n} {v['speed']:.2f}x ({v['wall_s_at_run_speed']:.1f} s, "
        f"{100 * abs(v['wall_s_at_run_speed'] - walls[n]) / walls[n]:.0f}%)"
        for n, v in s["predicted"].items()
        if "speed" in v
    )
    return (
        f"Machine speed: the profile's reference run took this many times its profiling time during each "
        f"policy's runs (ticked between steps, outside the timed wall), and the profile's prediction scaled "
        f"by it instead of the training factor (error): {runs}; prediction error at the runs' speed (max over "
        f"policies): {100 * s['prediction_error_at_run_speed']:.0f}%. One fixed micro-batch between steps "
        f"tracks the machine's load, but not what training itself adds."
    )


def factor_text(s: dict) -> str:
    """The measured training factor the predictions are scaled by, and the error without it."""
    return (
        f"Predicted wall s is the simulator's time at the profile's prices x {s['training_factor']:.3f}, the "
        f"measured busy time of the untimed runs (one of every policy, after the first timed round) over the profile's "
        f"price of their micro-batches (the profile times each layout in a loop of that one micro-batch); "
        f"at the profile's prices the prediction error (max over policies) is "
        f"{100 * s['prediction_error_at_profile_prices']:.0f}%."
    )


def _spread_text(s: dict) -> str:
    return f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f} ({100 * s['relative']:.0f}%)"


def write_report(out: Path, s: dict, pred: dict, errors: dict, real: dict) -> Path:
    """``report.md`` in ``out``: the setting, the table of every policy's runs with its
    prediction, the verdict on the spread, the planner settings, the timeline and the
    paper-scale section."""
    lines = _report_head(s, real) + _report_table(s, pred, errors) + _report_notes(s, pred)
    if s["simulated"]:
        lines += _paper_scale_lines(s["simulated"])
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _report_head(s: dict, real: dict) -> list[str]:
    r = s["real"]
    profiling = "reused a cached profile" if s["profile_reused"] else f"took {s['profile_s']:.0f} s"
    return [
        f"# dcparallel demo — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Real training of a {real['layers']}-layer Llama-style LM (hidden 128, vocab {s['vocab']}) on {r['world']} "
        f"gloo ranks (one CPU thread each), {r['samples_total']} samples ({r['lengths']}), "
        f"{real['tokens_per_step']:,} tokens per step. Memory budget per rank: "
        f"{r['memory_budget_bytes'] / 2**20:.1f} MiB ({r['budget_rule']}). Profiling {profiling}; "
        f"training time below excludes start-up and profiling. The first comparison was printed after "
        f"{s['first_result_s'] / 60:.1f} min, the whole demo took {s['demo_s'] / 60:.1f} min "
        f"({phases_text(s['phase_s'])}; {cpu_text(s['phase_cpu_s'])}).",
        "",
        f"Each policy ran {r['repeats']} times, interleaved with the others; its median run counts (of an even "
        "number, the faster of the middle two; all runs: "
        '"runs" column; their min / median / max and relative spread: "spread"). Every SP degree and '
        "recompute path was warmed up before the first timed run. Column meanings: docs/glossary.md.",
        "",
        "| policy | wall s | runs s | spread s (min / median / max) | tokens/s | steps | samples | "
        "loss first → last | predicted wall s | error | speedup vs bucket |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]


def _report_table(s: dict, pred: dict, errors: dict) -> list[str]:
    r = s["real"]
    same = len({v["samples_hash"] for v in r["policies"].values()}) == 1
    base = r["policies"]["bucket"]["wall_s"]
    lines = []
    for n, v in r["policies"].items():
        runs = ", ".join(f"{w:.1f}" for w in v["wall_s_runs"])
        lines.append(
            f"| {n} | {v['wall_s']:.1f} | {runs} | {_spread_text(v['spread'])} | {v['tokens_per_s']:,.0f} | "
            f"{v['steps']} | {v['samples']} | {v['loss_first']:.3f} → {v['loss_last']:.3f} | "
            f"{pred[n]['wall_s']:.1f} | {100 * errors[n]:.0f}% | {base / v['wall_s']:.2f} |"
        )
    return lines + [
        "",
        f"dcp vs bucket: **{r['speedup']:.2f}×**; dcp vs packed: **{r['speedup_vs_packed']:.2f}×**; "
        f"prediction error (max over policies): {100 * s['prediction_error']:.0f}%. "
        f"All runs trained the same samples in the same steps: {'yes' if same else 'NO'} "
        f"(hash of each step's sample ids).",
        "",
    ]


def _report_notes(s: dict, pred: dict) -> list[str]:
    lines = [factor_text(s), ""]
    if s.get("prediction_error_at_run_speed") is not None:
        lines += [speed_text(s), ""]
    if s["trust_notes"]:
        lines += ["**These timings cannot be trusted:** " + " ".join(s["trust_notes"]), ""]
    else:
        lines += ["Every policy's runs spread less than the differences compared above.", ""]
    return lines + [
        "Planner settings (from the simulator's replanning): " + "; ".join(f"{n}: {pred[n]['settings']}" for n in pred),
        "",
        "![timeline](timeline.png)",
        "",
        "Reading the timeline: colour is the SP degree of the micro-batch a rank runs, hatching marks "
        "recomputation, red is a rank waiting, dashed lines are step boundaries. With the longest samples "
        "needing SP = 2 on 2 ranks, the tuned `bucket` (like `packed`) runs everything as one SP = 2 group over "
        "both ranks: it never waits, it pays all-to-alls and recomputation on every micro-batch instead. `dcp` "
        "runs a step's long samples at SP = 2 first, then the short ones at SP = 1 on each rank (two phases), "
        "balanced so that neither rank waits long. Idle time under static data parallelism shows at scale: the "
        "simulated 32-GPU timeline below.",
        "",
    ]


def _paper_scale_lines(simulated: list[dict]) -> list[str]:
    names = list(simulated[0]["speedup_vs_bucket"])
    lines = [
        "## Paper scale (simulated, 32 × H200)",
        "",
        "![speedups](speedups.png)",
        "",
        "![paper-scale timeline](timeline_paper_scale.png)",
        "",
        "| scenario | distribution | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for x in simulated:
        lines.append(
            f"| {x['scenario']} | {x['distribution']} | "
            + " | ".join(f"{v:.2f}" for v in x["speedup_vs_bucket"].values())
            + " |"
        )
    return lines


def print_table(s: dict) -> None:
    r = s["real"]
    print(
        f"real run, {r['world']} CPU ranks, {r['samples_total']} samples, budget "
        f"{r['memory_budget_bytes'] / 2**20:.1f} MiB/rank"
    )
    print(
        f"{'policy':8s} {'wall s':>8s} {'tokens/s':>9s} {'predicted s':>12s} {'loss':>15s}  "
        f"runs s: min / median / max (spread)"
    )
    for n, v in r["policies"].items():
        print(
            f"{n:8s} {v['wall_s']:8.1f} {v['tokens_per_s']:9,.0f} {s['predicted'][n]['wall_s']:12.1f} "
            f"{v['loss_first']:6.3f} -> {v['loss_last']:.3f}  {_spread_text(v['spread'])}"
        )
    print(
        f"dcp speedup vs bucket {r['speedup']:.2f}x, vs packed {r['speedup_vs_packed']:.2f}x; "
        f"prediction error {100 * s['prediction_error']:.0f}%"
    )
    print(factor_text(s))
    if s.get("prediction_error_at_run_speed") is not None:
        print(speed_text(s))
    for note in s["trust_notes"]:
        print(f"NOTE: {note}")
    print(
        f"first comparison after {s['first_result_s'] / 60:.1f} min; demo took {s['demo_s'] / 60:.1f} min "
        f"({phases_text(s['phase_s'])}; {cpu_text(s['phase_cpu_s'])})"
    )
    print("artifacts: " + ", ".join(s["artifacts"]))


def phases_text(phase_s: dict) -> str:
    """Where the demo's time went: the launch (its start-up, profile, plans, warm-up, timed
    rounds and calibration), then the paper-scale simulation and the plots, in seconds."""
    rounds = " + ".join(f"{r:.0f}" for r in phase_s["rounds"])
    inside = sum(phase_s[k] for k in ("profile", "plan", "warm_up", "calibration")) + sum(phase_s["rounds"])
    return (
        f"training launch {phase_s['launch']:.0f} s: start-up and exit {phase_s['launch'] - inside:.0f}, profile "
        f"{phase_s['profile']:.0f}, plans {phase_s['plan']:.0f}, warm-up {phase_s['warm_up']:.0f}, timed rounds "
        f"{rounds}, calibration {phase_s['calibration']:.0f}; paper scale {phase_s['paper_scale']:.0f} s, plots "
        f"{phase_s['plots']:.0f} s"
    )


def cpu_text(phase_cpu_s: dict) -> str:
    """The processor seconds of the same phases (rank 0 in the launch, the orchestrator after
    it): what each phase costs whatever else runs on the cores."""
    c = phase_cpu_s
    rounds = " + ".join(f"{r:.0f}" for r in c["rounds"])
    return (
        f"processor seconds: profile {c['profile']:.0f}, plans {c['plan']:.0f}, warm-up {c['warm_up']:.0f}, "
        f"timed rounds {rounds}, calibration {c['calibration']:.0f} (rank 0); paper scale {c['paper_scale']:.0f}, "
        f"plots {c['plots']:.0f}"
    )


def print_plans(record: dict, file) -> None:
    """The first result, printed by the worker before any training: the profile (measured or
    reused, in how long, how much of it coarse for its budget), the memory budget and each
    policy's plan of the epoch as the simulator prices it."""
    if record["profile_reused"]:
        prof = "reused the cached profile"
    else:
        prof = (
            f"profiled in {record['profile_s']:.0f} s (budget {record['profile_budget_s']:.0f} s; layout chains "
            f"measured coarsely for it: {record['profile_chains_coarse']}, skipped: {record['profile_chains_skipped']})"
        )
    print(
        f"[demo] {prof}; memory budget {record['memory_budget_bytes'] / 2**20:.1f} MiB per rank "
        f"({record['budget_rule']})",
        file=file,
    )
    plans = record["plans"]
    steps = next(iter(plans.values()))["steps"]
    print(
        f"[demo] plans: the same {steps} steps of {record['tokens_per_step']:,} tokens for every policy, "
        f"simulated at the profile's prices:",
        file=file,
    )
    for n, p in plans.items():
        print(
            f"[demo]   {n:7s} {p['sim_s']:6.1f} s, ranks idle {100 * p['idle_fraction']:4.1f}%, {p['settings']}",
            file=file,
        )


def print_round(real: dict, pred: dict, done: int, rounds: int, file) -> None:
    """The comparison after ``done`` of ``rounds`` rounds, printed by the worker as the runs come
    in: per policy its median run so far and the spread of its runs, the prediction (scaled by
    the training factor of the untimed runs once they ran, at the profile's prices before), its
    error and the speedup vs bucket."""
    from dcparallel.apps.demo_predict import prediction_errors

    p = real["policies"]
    factor = real["training_factor"]
    key = "wall_s" if factor is not None else "wall_s_profile"
    errors = prediction_errors(pred, real, key)
    if done == 1:
        what = "first comparison: one timed run of each policy, so its spread is unknown yet"
    else:
        what = f"comparison after {done} timed runs of each policy: the median run counts"
    if factor is None:
        scaled = "predictions at the profile's prices (the untimed runs after this round measure the training factor)"
    else:
        scaled = f"predictions x {factor:.3f}, the training factor of the untimed run of each policy"
    print(f"[demo] round {done} of {rounds}, {what}; {scaled}", file=file)
    print(
        f"[demo]   {'policy':7s} {'wall s':>7s} {'predicted s':>11s} {'error':>6s} {'vs bucket':>9s}  runs s", file=file
    )
    for n, v in p.items():
        runs = ", ".join(f"{w:.1f}" for w in v["walls"])
        spread_s = f" (spread {100 * spread(v['walls'])['relative']:.0f}%)" if done > 1 else ""
        print(
            f"[demo]   {n:7s} {v['wall_s']:7.1f} {pred[n][key]:11.1f} {100 * errors[n]:5.0f}% "
            f"{p['bucket']['wall_s'] / v['wall_s']:8.2f}x  {runs}{spread_s}",
            file=file,
        )
