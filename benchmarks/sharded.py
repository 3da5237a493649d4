"""Models larger than one GPU, planned with parameter-shard blocks: for 8B, 32B and 70B text
models and 13-14B video models on 8, 32, 64 and 256 simulated H200, the shard size
``auto`` picks, the planned memory per rank, and the simulated time of ``dcp``, ``bucket`` and
``megatron-dcp`` at that shard size (analytic H200 cost model).

    PYTHONPATH=. .venv/bin/python benchmarks/sharded.py --out benchmarks/sharded_cpu_2026-12-03

Weak scaling: a step holds the scenario's tokens per 32 GPUs (text 4M, video 8M latent tokens
of the preset's own patchify rule) times world / 32; the data is the `balanced` distribution;
each cell plans and simulates its first ``--steps`` steps (the same steps for every policy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.auto_shard import auto_shard_size
from dcparallel.cost.base import model_state_bytes
from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import form_steps
from dcparallel.plan.types import NoLayoutFits
from dcparallel.scenarios import MODEL_PRESETS, SCENARIOS, sample_sizes
from dcparallel.sim.run import plan_epoch
from dcparallel.spec import GiB, Workload, h200_cluster

MODELS = ["llama-8b", "qwen-32b", "llama-70b", "wan-14b", "hunyuanvideo-13b"]
WORLDS = [8, 32, 64, 256]
POLICIES = ["dcp", "bucket", "megatron-dcp"]


def cell(name: str, world: int, num_steps: int, distribution: str) -> dict:
    model = MODEL_PRESETS[name]
    sc = SCENARIOS[model.kind]
    tps = sc.tokens_per_step * world // 32
    base = h200_cluster(world)
    out = {
        "model": name,
        "params_b": round(model.num_params / 1e9, 2),
        "world": world,
        "tokens_per_step": tps,
        "states_s1_gib": round(model_state_bytes(model, world) / GiB, 1),
    }
    # samples drawn by the scenario (its own token rule) until the preset's tokens fill the steps
    sizes, toks = [], 0
    pool = sample_sizes(model.kind, distribution, epoch_tokens=4 * num_steps * tps)
    for s in pool:
        sizes.append(s)
        toks += model.tokens(s)
        if toks >= num_steps * tps:
            break
    t0 = time.perf_counter()
    try:
        shard = auto_shard_size(model, base, sizes)
    except ValueError as e:
        out["error"] = str(e)
        return out
    cluster = dataclasses.replace(base, shard_size=shard)
    cost = AnalyticCost(model, cluster)
    w = Workload(model, tuple(sizes))
    ctx = PlanContext(w, cost, cluster)
    steps = form_steps(w.tokens, seed=0, tokens_per_step=tps)[:num_steps]
    out.update(
        shard_size=shard,
        states_gib=round(cost.model_state_bytes() / GiB, 1),
        budget_gib=round(cluster.memory_bytes / GiB, 1),
        sync_s=round(cost.grad_sync_time(), 3),
        steps=len(steps),
        samples=sum(len(s.sample_ids) for s in steps),
        policies={},
    )
    for pol in POLICIES:
        try:
            run = plan_epoch(ctx, steps, pol)
        except NoLayoutFits as e:
            out["policies"][pol] = {"error": str(e)}
            continue
        sim = run.sim
        out["policies"][pol] = {
            "time_s": round(sim.total_time, 2),
            "step_s_median": round(sim.step_time_median, 2),
            "tokens_per_s_per_gpu": round(sim.tokens_per_s / world, 1),
            "idle": round(sim.idle_fraction, 4),
            "peak_gib": round(sim.peak_memory_fraction * sim.memory_bytes / GiB, 1),
            "memory_violations": sim.memory_violations,
            "sp_sizes": sorted({g.sp for p in run.plans for g in p.groups if g.micro_batches}),
        }
    # auto takes the smallest shard size that fits, not the fastest: dcp one shard size up, for comparison
    bigger = [k for k in base.shard_sizes() if k > shard]
    if bigger and "error" not in out["policies"]["dcp"]:
        c2 = dataclasses.replace(base, shard_size=bigger[0])
        try:
            ctx2 = PlanContext(w, AnalyticCost(model, c2), c2)
            t2 = plan_epoch(ctx2, steps, "dcp").sim.total_time
            out["dcp_next"] = {"shard_size": bigger[0], "time_s": round(t2, 2)}
        except ValueError as e:
            out["dcp_next"] = {"shard_size": bigger[0], "error": str(e)}
    # the shard size auto picks on 80 GB cards (72 GiB usable, the H200's share of its card)
    try:
        out["auto_80gb"] = auto_shard_size(model, dataclasses.replace(base, memory_bytes=72 * GiB), sizes)
    except ValueError:
        out["auto_80gb"] = None
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def report(rows: list[dict], args, seconds: float) -> str:
    import numpy

    lines = [
        "# Models larger than one GPU: shard blocks planned and simulated (CPU, analytic H200 model)",
        "",
        f"Command: `PYTHONPATH=. .venv/bin/python benchmarks/sharded.py --steps {args.steps} --out {args.out}` "
        f"({seconds:.0f} s).",
        f"Machine: a 2-core {platform.machine()} CPU machine shared with other work, "
        f"Python {platform.python_version()}, numpy {numpy.__version__}; no GPU: every number is the analytic "
        f"H200 cost model (`cost/analytic.py`, `cost/shard.py`) on simulated 8-GPU nodes (NVLink 4 at 315 GB/s, "
        f"400 Gb/s InfiniBand per GPU at 40 GB/s, 128 GiB usable per GPU).",
        "",
        f"Data: the `balanced` distribution of each kind's scenario, weak scaling (text 4M tokens, video 8M latent "
        f"tokens per step per 32 GPUs); the first {args.steps} steps of each cell, the same steps for every policy. "
        "`auto` = the smallest shard size with which the model states and the smallest sample at the narrowest "
        "SP fit, and the largest sample fits at the widest SP (full recomputation). States at s=1 = what every "
        "rank would hold without shard blocks (P(2 + 4 + 12/W)).",
        "",
        "| model | GPUs | states s=1 (GiB) | auto s | states (GiB) | sync (s) | policy | time (s) | step (s) "
        "| tokens/s/GPU | idle | peak (GiB) | SP sizes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    side = [
        "",
        "`auto` is the smallest shard size that fits, not the fastest: `dcp` one shard size up, and the "
        "shard size `auto` picks on 80 GB cards (72 GiB usable; the same states and data):",
        "",
        "| model | GPUs | auto s | dcp time (s) | next s | dcp time (s) | auto s on 80 GB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            side.append(f"| {r['model']} | {r['world']} | does not fit | | | | |")
            continue
        nxt = r.get("dcp_next", {})
        d = r["policies"]["dcp"]
        side.append(
            f"| {r['model']} | {r['world']} | {r['shard_size']} | {d.get('time_s', '-')} | "
            f"{nxt.get('shard_size', '-')} | {nxt.get('time_s', nxt.get('error', '-'))} | "
            f"{r['auto_80gb'] if r['auto_80gb'] is not None else 'does not fit'} |"
        )
    for r in rows:
        head = f"| {r['model']} ({r['params_b']}B) | {r['world']} | {r['states_s1_gib']} |"
        if "error" in r:
            lines.append(f"{head} does not fit | | | | | | | | | |")
            continue
        for i, (pol, v) in enumerate(r["policies"].items()):
            pre = head if i == 0 else "| | | |"
            mid = f" {r['shard_size']} | {r['states_gib']} | {r['sync_s']} |" if i == 0 else " | | |"
            if "error" in v:
                lines.append(f"{pre}{mid} {pol} | cannot run: {v['error']} | | | | | |")
                continue
            viol = f" ({v['memory_violations']} over)" if v["memory_violations"] else ""
            lines.append(
                f"{pre}{mid} {pol} | {v['time_s']} | {v['step_s_median']} | {v['tokens_per_s_per_gpu']:,.0f} "
                f"| {v['idle']:.3f} | {v['peak_gib']}{viol} | {v['sp_sizes']} |"
            )
    lines += side
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "Cells that do not fit, and why:", ""]
        lines += [f"- {r['model']} on {r['world']} GPUs: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="steps planned per cell (default 2)")
    ap.add_argument("--distribution", default="balanced")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for name in MODELS:
        for world in WORLDS:
            r = cell(name, world, args.steps, args.distribution)
            print(json.dumps(r), file=sys.stderr)
            rows.append(r)
    seconds = time.perf_counter() - t0
    text = report(rows, args, seconds)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
