"""Real 2-rank CPU training per policy on two length distributions (the demo's run), into a
dated report.

    .venv/bin/python benchmarks/real_cpu.py      # ~9 minutes on 2 cores

Runs `dcparallel demo` on the built-in skewed dataset and on
`examples/lengths/heavy_tail.txt`, without the paper-scale simulation, and writes
`benchmarks/real-cpu_<date>.md` (+ the raw JSON and the timeline plots).
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from dcparallel.apps.demo_report import RERUN, spread, trust_notes

HERE = Path(__file__).parent
ROOT = HERE.parent


def main() -> int:
    today = dt.date.today().isoformat()
    runs = [("built-in skewed", []), ("heavy_tail.txt", ["--lengths", str(ROOT / "examples/lengths/heavy_tail.txt")])]
    results = []
    if "--report-only" in sys.argv:  # rebuild the markdown from the saved JSON and plots
        saved = json.loads((HERE / f"real-cpu_{today}.json").read_text())
        results = [
            (name, s, HERE / f"real-cpu_{today}_timeline_{i}.png") for i, ((name, _), s) in enumerate(zip(runs, saved))
        ]
        runs = []
    for name, extra in runs:
        out = ROOT / "out" / f"real-cpu-{len(results)}"
        cmd = [sys.executable, "-m", "dcparallel", "demo", "--out", str(out), "--skip-paper-scale", "--json", *extra]
        print(f"[real-cpu] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if p.returncode != 0:
            print(p.stderr[-4000:], file=sys.stderr)
            return p.returncode
        s = json.loads(p.stdout.strip().splitlines()[-1])
        plot = HERE / f"real-cpu_{today}_timeline_{len(results)}.png"
        shutil.copy(out / "timeline.png", plot)
        results.append((name, s, plot))
    if runs:
        (HERE / f"real-cpu_{today}.json").write_text(json.dumps([s for _, s, _ in results], indent=1))
    lines = [
        f"# Real training on CPU, 2 gloo ranks — {today}",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads visible, 2 cores shared; "
        f"Python {platform.python_version()}, torch {torch.__version__}. Each rank runs one thread. "
        "Command: `.venv/bin/python benchmarks/real_cpu.py` (= `dcparallel demo --skip-paper-scale` on each "
        "dataset). Timings vary 20–40% between runs on these shared machines; compare within a table.",
        "",
        "Model: Llama-style LM, 4 layers, hidden 128, 4 heads, vocab 256 (fp32). Every policy trains the same "
        "samples in the same optimizer steps from the same initial weights; the wall time is the training "
        "loop only (start-up and profiling excluded), after a warm-up of every SP degree and recompute path. "
        "Each policy runs twice, interleaved with the others (bucket, packed, dcp, bucket, ...); its faster "
        "run counts, and both are listed with their spread (min / median / max, (max - min) / median); "
        f"where a spread exceeds the difference compared, the report says so ({RERUN}). "
        "Predicted = the simulator replaying the same plans on the profile measured in the same launch, "
        "plus the optimizer step timed before training.",
        "",
    ]
    for name, s, plot in results:
        r = s["real"]
        lines += [
            f"## {name}: {r['samples_total']} samples",
            "",
            f"Memory budget {r['memory_budget_bytes'] / 2**20:.1f} MiB per rank ({r['budget_rule']}).",
            "",
            "| policy | wall s | runs s | spread s (min / median / max) | tokens/s | steps | samples | "
            "loss first → last | predicted s | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for n, v in r["policies"].items():
            pw = s["predicted"][n]["wall_s"]
            runs = ", ".join(f"{w:.1f}" for w in v["wall_s_runs"])
            sp = spread(v["wall_s_runs"])
            lines.append(
                f"| {n} | {v['wall_s']:.1f} | {runs} | {sp['min']:.1f} / {sp['median']:.1f} / {sp['max']:.1f} "
                f"({100 * sp['relative']:.0f}%) | {v['tokens_per_s']:,.0f} | {v['steps']} | "
                f"{v['samples']} | "
                f"{v['loss_first']:.3f} → {v['loss_last']:.3f} | {pw:.1f} | "
                f"{100 * abs(pw - v['wall_s']) / v['wall_s']:.0f}% |"
            )
        hashes = {v["samples_hash"] for v in r["policies"].values()}
        lines += [
            "",
            f"**dcp vs bucket {r['speedup']:.2f}×, dcp vs packed {r['speedup_vs_packed']:.2f}×**; "
            f"prediction error {100 * s['prediction_error']:.0f}%; same samples in the same steps: "
            f"{'yes' if len(hashes) == 1 else 'NO'}.",
            "",
        ]
        errors = {n: abs(s["predicted"][n]["wall_s"] - v["wall_s"]) / v["wall_s"] for n, v in r["policies"].items()}
        notes = trust_notes({n: v["wall_s_runs"] for n, v in r["policies"].items()}, errors)
        if notes:
            lines += ["**These timings cannot be trusted:** " + " ".join(notes), ""]
        lines += [f"![timeline]({plot.name})", ""]
    notes = HERE / "real_cpu_notes.md"
    if notes.exists():
        lines += [notes.read_text().strip()]
    report = HERE / f"real-cpu_{today}.md"
    report.write_text("\n".join(lines) + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
