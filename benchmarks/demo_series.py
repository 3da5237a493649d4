"""Run `dcparallel demo --lengths FILE` several times, each with a fresh profile, and tabulate.

    PYTHONPATH=. .venv/bin/python benchmarks/demo_series.py --runs 5 --lengths benchmarks/skewed600.txt \
        --out /tmp/demo-series --report benchmarks/demo-lengths_cpu_<date>.md

Each run trains five rounds with a profile measured in full (`SERIES_SETTINGS`, as the report
did) and writes its own folder (`run1`, `run2`, ...) with no cached profile, so every run
profiles the model again; `--collect DIR [DIR ...]` tabulates runs made before instead. The
table has per run: profiling time, each policy's counted (median) wall time and its prediction,
the prediction error (max over policies, as the demo reports it: the profile's prices times the
training factor measured on untimed runs between the timed rounds), the factor, the error
without it, the error at the machine's speed during the timed runs instead (the profile's
reference run ticked between their steps), and `dcp`'s speedup over `bucket` and `packed`.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

POLICIES = ("bucket", "packed", "dcp")


#: the settings of the series' report (demo-lengths_cpu_2026-12-04.md), not the demo's quicker defaults:
#: five rounds and a profile with no budget that binds (a day)
SERIES_SETTINGS = ("--repeats", "5", "--profile-budget", "86400")


def run_demo(out: Path, lengths: str) -> None:
    cmd = [sys.executable, "-m", "dcparallel", "demo", "--lengths", lengths, "--out", str(out), "--skip-paper-scale"]
    cmd += SERIES_SETTINGS
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def row(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    if s.get("profile_reused"):
        raise ValueError(f"{run_dir}: the demo reused a cached profile; a series needs a fresh one per run")
    real, pred = s["real"]["policies"], s["predicted"]
    errs = {p: abs(pred[p]["wall_s"] - real[p]["wall_s"]) / real[p]["wall_s"] for p in POLICIES}
    return {
        "run": run_dir.name,
        "profile_s": s["profile_s"],
        "demo_s": s["demo_s"],
        "wall": {p: real[p]["wall_s"] for p in POLICIES},
        "spread": {p: real[p]["spread"]["relative"] for p in POLICIES},
        "pred": {p: pred[p]["wall_s"] for p in POLICIES},
        "err": errs,
        "error": s["prediction_error"],
        "factor": s.get("training_factor", 1.0),
        "error_profile": s.get("prediction_error_at_profile_prices", s["prediction_error"]),
        "error_speed": s.get("prediction_error_at_run_speed"),
        "speedup": s["real"]["speedup"],
        "speedup_vs_packed": s["real"]["speedup_vs_packed"],
    }


def table(rows: list[dict]) -> str:
    head = (
        "| run | profiling s | "
        + " | ".join(f"{p} s (pred., error)" for p in POLICIES)
        + " | prediction error (max) | training factor | error at profile prices (max)"
        " | error at the runs' speed (max) | dcp vs bucket | dcp vs packed |"
    )
    lines = [head, "| " + " | ".join(["---"] * (len(POLICIES) + 8)) + " |"]
    for r in rows:
        cells = [f"{r['wall'][p]:.1f} ({r['pred'][p]:.1f}, {r['err'][p]:.0%})" for p in POLICIES]
        lines.append(
            f"| {r['run']} | {r['profile_s']:.0f} | "
            + " | ".join(cells)
            + f" | {r['error']:.0%} | {r['factor']:.3f} | {r['error_profile']:.0%}"
            + (f" | {r['error_speed']:.0%}" if r["error_speed"] is not None else " | -")
            + f" | {r['speedup']:.2f}x | {r['speedup_vs_packed']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lengths", default="benchmarks/skewed600.txt")
    ap.add_argument("--out", default="/tmp/demo-series")
    ap.add_argument("--collect", nargs="*", help="tabulate these run folders instead of running")
    ap.add_argument("--report", help="write the table (with the command and machine) to this file")
    args = ap.parse_args()
    if args.collect:
        dirs = [Path(d) for d in args.collect]
    else:
        dirs = [Path(args.out) / f"run{i + 1}" for i in range(args.runs)]
        for d in dirs:
            if (d / "profile.json").exists():
                raise ValueError(f"{d} holds a profile from an earlier run; pass a fresh --out")
            run_demo(d, args.lengths)
    rows = [row(d) for d in dirs]
    worst = max(r["error"] for r in rows)
    least = min(r["speedup"] for r in rows)
    text = (
        table(rows) + f"\n\nWorst prediction error {worst:.0%}; least `dcp` speedup over `bucket` "
        f"{least:.2f}x over {len(rows)} runs.\n"
    )
    print(text)
    if args.report:
        import torch

        meta = (
            f"Machine: {platform.machine()}, {platform.processor() or 'CPU'}; Python "
            f"{platform.python_version()}, torch {torch.__version__}.\n\n"
        )
        Path(args.report).write_text(meta + text)


if __name__ == "__main__":
    main()
