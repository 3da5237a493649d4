"""Golden plan hashes: one hash per scale-report cell of the plans a policy makes, to show a
planner change (a refactor, a speed-up) keeps every plan, or to list the cells it changes.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_hashes.py --out /tmp/golden.json
    PYTHONPATH=. .venv/bin/python benchmarks/plan_hashes.py --check /tmp/golden.json

A cell is the scale report's (`sim_scale.py`): scenario, distribution or mix, world, step
budget; its first `--steps` steps are planned (the cell's own step former, seed 0). A plan's
hash covers every group's ranks and phase and every micro-batch's sample ids and layout, in
order; the cell's hash is the hash of its steps' hashes. `--check` plans again and lists the
cells whose hash differs, with the predicted epoch time before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from benchmarks.sim_scale import cell_workload, distributions
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import SCENARIOS
from dcparallel.sim.replay import simulate, step_seconds


def plan_hash(plan) -> str:
    return hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cell_hashes(scenario: str, dist: str, world: int, budget: str, policy: str, steps: int) -> dict:
    sc = SCENARIOS[scenario]
    tps = max(sc.tokens_per_step * world // 32 if budget == "weak" else sc.tokens_per_step, 1)
    wl = cell_workload(scenario, dist, tps, steps)
    cl = sc.cluster(world)
    ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
    todo = form_steps(wl.tokens, seed=0, tokens_per_step=tps)[:steps]
    t0 = time.process_time()
    planner = make_planner(policy, ctx, todo, score=step_seconds(ctx))
    plans = [planner.plan(s) for s in todo]
    cpu = time.process_time() - t0
    hashes = [plan_hash(p) for p in plans]
    return {
        "hash": hashlib.sha256("".join(hashes).encode()).hexdigest()[:16],
        "steps": hashes,
        "epoch_s": round(simulate(plans, ctx).total_time, 6),
        "cpu_s": round(cpu, 2),
    }


def cells(worlds: list[int], budgets: list[str], scenarios: list[str], dists: str):
    for budget in budgets:
        for world in worlds:
            if budget == "strong" and world == 32:
                continue  # the strong budget at 32 GPUs is the weak one
            for scenario in scenarios:
                for dist in distributions(scenario, dists):
                    yield budget, world, scenario, dist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="32,256,1024,4096")
    ap.add_argument("--budgets", default="weak,strong")
    ap.add_argument("--scenarios", default="text,video")
    ap.add_argument("--distributions", default="all")
    ap.add_argument("--policy", default="dcp")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", help="write the hashes here (JSON)")
    ap.add_argument("--check", help="compare with hashes written before; exit 1 if any cell differs")
    args = ap.parse_args()
    golden = json.loads(Path(args.check).read_text())["cells"] if args.check else None
    out, changed = {}, []
    todo = list(
        cells(
            [int(w) for w in args.worlds.split(",")],
            args.budgets.split(","),
            args.scenarios.split(","),
            args.distributions,
        )
    )
    for i, (budget, world, scenario, dist) in enumerate(todo):
        key = f"{budget} {world} {scenario}/{dist}"
        if golden is not None and key not in golden:
            continue
        got = cell_hashes(scenario, dist, world, budget, args.policy, args.steps)
        out[key] = got
        mark = ""
        if golden is not None:
            old = golden[key]
            if old["hash"] != got["hash"]:
                diff = sum(a != b for a, b in zip(old["steps"], got["steps"]))
                changed.append(key)
                mark = (
                    f"  CHANGED: {diff} of {len(got['steps'])} steps, "
                    f"epoch {old['epoch_s']:.4f} -> {got['epoch_s']:.4f} s"
                )
        print(f"[{i + 1}/{len(todo)}] {key}: {got['hash']} ({got['cpu_s']:.1f} CPU s){mark}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({"policy": args.policy, "steps": args.steps, "cells": out}, indent=1))
    if golden is not None:
        print(
            f"{len(out) - len(changed)} of {len(out)} cells identical"
            + (f"; changed: {', '.join(changed)}" if changed else "")
        )
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
