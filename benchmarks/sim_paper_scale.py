"""Every scenario x distribution x policy at the paper's scale (32 H200 = 4 nodes x 8),
simulated on the analytic cost model fitted to the H200 calibration.

    .venv/bin/python benchmarks/sim_paper_scale.py [--out benchmarks/sim-paper-scale_<date>.md]

Writes the table (markdown) and a JSON file next to it with every `simulate --json` object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

from dcparallel.apps.simulate import paper_scale
from dcparallel.cost.analytic import fit_calibration
from dcparallel.plan.policies import ALL
from dcparallel.report.plots import plot_paper_scale_timeline, plot_speedups
from dcparallel.scenarios import ALPHA, DEFAULT_SEED, EPOCH_STEPS, SCENARIOS

# DCP v1 (32 H100, Open-Sora 1.1B) speedups over bucket parallel, as published
PUBLISHED = {"short": (1.55, 2.12, 2.48), "balanced": (1.23, 1.68, 1.78), "long": (1.07, 1.27, 1.28)}


def main() -> int:
    ap = argparse.ArgumentParser()
    today = dt.date.today().isoformat()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / f"sim-paper-scale_{today}.md")
    ap.add_argument("--world", type=int, default=32)
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = paper_scale(args.world, desc="scenarios")
    elapsed = time.perf_counter() - t0
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    bars = plot_speedups(results, args.out.with_suffix(".png"))
    timeline = plot_paper_scale_timeline(args.out.with_name(args.out.stem + "_timeline.png"), args.world)

    lines = [f"# Paper-scale simulation — {args.world} × H200 (analytic cost model) — {today}", ""]
    lines += [
        "Command: `.venv/bin/python benchmarks/sim_paper_scale.py` "
        f"(machine: {platform.machine()} CPU, Python {platform.python_version()}; {elapsed:.0f} s for all "
        f"{len(results)} workloads × {len(ALL)} policies). Raw numbers: `{args.out.with_suffix('.json').name}`.",
        "",
        f"Cluster: {args.world} GPUs, 8 per node; usable memory 128 GiB per GPU; NVLink 315 GB/s and "
        "InfiniBand 40 GB/s per GPU one way (datasheet figures derated — assumptions, not measured; "
        "`dcparallel/spec.py:h200_cluster`). Time and memory of every micro-batch come from "
        "`AnalyticCost` fitted to the H200 calibration (`dcparallel/calibration/`, one H200, bf16, "
        "torch 2.11, SDPA). Every policy plans the same steps (shared step former); "
        f"an epoch is about {EPOCH_STEPS} steps; seed {DEFAULT_SEED}; Zipf exponent {ALPHA}.",
        "",
        "Scenarios: `video` = Open-Sora-1.2-like STDiT (28 spatial+temporal block pairs, hidden 1152, 16 heads, "
        f"≈1.2 B parameters), {SCENARIOS['video'].tokens_per_step:,} latent tokens per step; `text` = Llama-7B-like "
        f"(32 layers, hidden 4096, 32 heads, causal), {SCENARIOS['text'].tokens_per_step:,} tokens per step.",
        "",
        "## Speedup over the tuned bucket baseline (epoch time of `bucket` / epoch time of the policy)",
        "",
        f"![speedups]({bars.name})",
        "",
        "| scenario | distribution | tokens in samples > 64k | bucket (tuned) | bucket-default | packed | "
        "dcp-intra | dcp-inter | dcp-inter-pac | dcp (ours: + two-phase steps) | "
        "published intra / inter / inter+PAC |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        s = r["speedup_vs_bucket"]
        pub = "/".join(f"{x:.2f}" for x in PUBLISHED[r["distribution"]]) if r["scenario"] == "video" else "—"
        lines.append(
            f"| {r['scenario']} | {r['distribution']} | {100 * r['long_token_share']:.0f}% | "
            f"1.00 (sp={r['bucket_sp']}, {r['bucket_recompute']}) | {s['bucket-default']:.2f} | {s['packed']:.2f} | "
            f"{s['dcp-intra']:.2f} | {s['dcp-inter']:.2f} | {s['dcp-inter-pac']:.2f} | **{s['dcp']:.2f}** | {pub} |"
        )
    lines += ["", "## Per policy", ""]
    for r in results:
        lines += [
            f"### {r['scenario']} / {r['distribution']} — {r['samples_total']} samples, {r['steps']} steps, "
            f"lower bound {r['lower_bound_s']:.1f} s",
            "",
            "| policy | tokens/s | step s (median) | idle | lower-bound efficiency | plan ms/step | "
            "setup ms | peak memory | settings |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, v in r["policies"].items():
            st = {k: x for k, x in v["settings"].items() if k != "tried_s"}
            lines.append(
                f"| {name} | {v['tokens_per_s']:,.0f} | {v['step_time_s_median']:.2f} | "
                f"{v['idle_fraction']:.3f} | {v['lower_bound_efficiency']:.3f} | "
                f"{v['plan_ms_per_step']:.1f} | {v['setup_ms']:.0f} | {v['peak_memory_fraction']:.2f} | "
                f"{st} |"
            )
        tried = r["policies"]["bucket"]["settings"].get("tried_s", {})
        if tried:
            best = min(tried.values())
            lines += [
                "",
                "Bucket tuning (simulated seconds on the tuning steps, relative to the best): "
                + ", ".join(f"{k} {v / best:.2f}" for k, v in sorted(tried.items(), key=lambda kv: kv[1])),
            ]
        lines.append("")
    lines += [
        "## Where the time goes: the first steps of video / short, per rank",
        "",
        f"![timeline]({timeline.name})",
        "",
        "Simulated busy / idle / gradient-sync spans of every rank for the first four steps; "
        "each panel is on the same time axis.",
        "",
    ]
    lines += [
        "## Cost-model fit (H200 calibration rows)",
        "",
        "| calibration | rows | time error mean | time error max | floor ms | lin ns/token | "
        "attn ps/pair | phi attn | phi mlp | act bytes/token/layer |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in fit_report():
        lines.append(
            f"| {f['calibration']} | {f['rows']} | {f['time_err_mean']:.3f} | {f['time_err_max']:.3f} | "
            f"{f['floor_ms']} | {f['lin_ns_per_token']} | {f['attn_ps_per_pair']} | {f['phi_attn']} | "
            f"{f['phi_mlp']} | {f['act_bytes_per_token']} |"
        )
    notes = Path(__file__).parent / "sim_paper_scale_notes.md"
    if notes.exists():
        lines += ["", notes.read_text().strip()]
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out)
    return 0


def fit_report() -> list[dict]:
    """The fitted constants and fit errors, for reports."""
    out = []
    for kind in ("llama-7b", "stdit-1.1b"):
        c = fit_calibration(kind)
        out.append(
            {
                "calibration": kind,
                "rows": c.num_rows,
                "time_err_mean": round(c.time_err_mean, 4),
                "time_err_max": round(c.time_err_max, 4),
                "floor_ms": round(c.floor_s * 1e3, 3),
                "p": c.p,
                "lin_ns_per_token": round(c.lin_s_per_token * 1e9, 3),
                "attn_ps_per_pair": round(c.attn_s_per_pair * 1e12, 4),
                "phi_attn": round(c.phi_attn, 3),
                "phi_mlp": round(c.phi_mlp, 3),
                "act_bytes_per_token": round(c.act_attn + c.act_mlp + c.act_rest),
                "transient_none": round(c.transient_none, 3),
                "transient_rec": round(c.transient_rec, 3),
            }
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
