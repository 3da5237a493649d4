"""Golden plan hashes: one hash per scale-report cell of the plans a policy makes, to show a
planner change (a refactor, a speed-up) keeps every plan, or to list the cells it changes.

    PYTHONPATH=. .venv/bin/python benchmarks/tools/plan_hashes.py --out /tmp/golden.json
    PYTHONPATH=. .venv/bin/python benchmarks/tools/plan_hashes.py --check /tmp/golden.json
    PYTHONPATH=. .venv/bin/python benchmarks/tools/plan_hashes.py --golden  # tests/golden/plan_hashes.json

A cell is the scale report's (`sim_scale.py`): scenario, distribution or mix, world, step
budget, and whether the cluster allows ring attention (`--ring`: `ClusterSpec.ring`); its
first `--steps` steps are planned (the cell's own step former, seed 0). A plan's hash covers
every group's ranks and phase and every micro-batch's sample ids and layout, in order; the
cell's hash is the hash of its steps' hashes. `--check` plans again and lists the cells whose
hash differs, with the predicted epoch time before and after.

`--golden` writes the hashes of `GOLDEN_CELLS` (`dcp`, 2 steps each: a few seconds of
planning in all) to `tests/golden/plan_hashes.json`, which `tests/unit/test_golden_plans.py`
recomputes: a planner change that alters any of those plans fails it, naming the cell. Write
it again only for a change meant to alter plans, and say so in the commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks.sim_scale import cell_workload, distributions
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import SCENARIOS
from dcparallel.sim.replay import simulate, step_seconds

GOLDEN_PATH = Path(__file__).resolve().parents[2] / "tests" / "golden" / "plan_hashes.json"
GOLDEN_POLICY, GOLDEN_STEPS = "dcp", 2


class Cell(NamedTuple):
    """One scale-report cell: `budget` "weak" (the 32-GPU step budget scaled with the world)
    or "strong" (the scenario's budget at every world)."""

    budget: str
    world: int
    scenario: str
    distribution: str
    ring: bool = False

    @property
    def key(self) -> str:
        return f"{self.budget} {self.world} {self.scenario}/{self.distribution}" + (" ring" if self.ring else "")


#: the cells of the golden hashes: both scenarios, their distributions and mixes (those of
#: `dcparallel/mixes.py` among them), 32 to 1024 GPUs, weak and strong, ring on in two; among
#: them steps where the per-sample planner, the per-sample packing, the finer text classes and
#: the static layouts run (the chain-alone candidate needs SP degrees outside one chain, which
#: the scenarios' models on 8-GPU nodes never have: `tests/unit/test_mixed_sizes.py` plans those)
GOLDEN_CELLS: tuple[Cell, ...] = (
    Cell("weak", 32, "text", "short"),
    Cell("weak", 32, "video", "balanced"),
    Cell("weak", 64, "text", "long-cpt"),
    Cell("weak", 64, "video", "image-buckets"),
    Cell("strong", 64, "text", "long", ring=True),
    Cell("weak", 256, "text", "long"),
    Cell("weak", 256, "video", "long"),
    Cell("strong", 256, "text", "sft-chat-long"),
    Cell("strong", 256, "text", "long", ring=True),
    Cell("strong", 1024, "text", "balanced"),
    Cell("strong", 1024, "video", "short"),
)


def plan_hash(plan) -> str:
    return hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cell_plans(cell: Cell, policy: str, steps: int):
    """The cell's context and the plans `policy` makes of its first `steps` steps, with the
    CPU seconds of building the planner and planning them."""
    sc = SCENARIOS[cell.scenario]
    tps = max(sc.tokens_per_step * cell.world // 32 if cell.budget == "weak" else sc.tokens_per_step, 1)
    wl = cell_workload(cell.scenario, cell.distribution, tps, steps)
    cl = dataclasses.replace(sc.cluster(cell.world), ring=cell.ring)
    ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
    todo = form_steps(wl.tokens, seed=0, tokens_per_step=tps)[:steps]
    t0 = time.process_time()
    planner = make_planner(policy, ctx, todo, score=step_seconds(ctx))
    plans = [planner.plan(s) for s in todo]
    return ctx, plans, time.process_time() - t0


def cell_hash(step_hashes: list[str]) -> str:
    return hashlib.sha256("".join(step_hashes).encode()).hexdigest()[:16]


def cell_hashes(cell: Cell, policy: str, steps: int, epoch: bool = True) -> dict:
    ctx, plans, cpu = cell_plans(cell, policy, steps)
    hashes = [plan_hash(p) for p in plans]
    out = {"hash": cell_hash(hashes), "steps": hashes}
    if epoch:
        out["epoch_s"] = round(simulate(plans, ctx).total_time, 6)
    out["cpu_s"] = round(cpu, 2)
    return out


def cells(worlds: list[int], budgets: list[str], scenarios: list[str], dists: str, ring: bool = False):
    for budget in budgets:
        for world in worlds:
            if budget == "strong" and world == 32:
                continue  # the strong budget at 32 GPUs is the weak one
            for scenario in scenarios:
                for dist in distributions(scenario, dists):
                    yield Cell(budget, world, scenario, dist, ring)


def write_golden() -> int:
    """Write `GOLDEN_CELLS`' hashes (no simulated epoch: the test compares plans only)."""
    out = {}
    for cell in GOLDEN_CELLS:
        got = cell_hashes(cell, GOLDEN_POLICY, GOLDEN_STEPS, epoch=False)
        print(f"{cell.key}: {got['hash']} ({got.pop('cpu_s'):.2f} CPU s)", file=sys.stderr)
        out[cell.key] = {**cell._asdict(), **got}
    GOLDEN_PATH.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_PATH.write_text(json.dumps({"policy": GOLDEN_POLICY, "steps": GOLDEN_STEPS, "cells": out}, indent=1) + "\n")
    print(f"wrote {len(out)} cells to {GOLDEN_PATH}", file=sys.stderr)
    return 0


def compare(key: str, old: dict, got: dict) -> str:
    """ "" where the cell's plans are the same, else what changed."""
    if old["hash"] == got["hash"]:
        return ""
    diff = sum(a != b for a, b in zip(old["steps"], got["steps"]))
    return f"  CHANGED: {diff} of {len(got['steps'])} steps, epoch {old['epoch_s']:.4f} -> {got['epoch_s']:.4f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="32,256,1024,4096")
    ap.add_argument("--budgets", default="weak,strong")
    ap.add_argument("--scenarios", default="text,video")
    ap.add_argument("--distributions", default="all")
    ap.add_argument("--ring", action="store_true", help="clusters that allow ring attention")
    ap.add_argument("--policy", default="dcp")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", help="write the hashes here (JSON)")
    ap.add_argument("--check", help="compare with hashes written before; exit 1 if any cell differs")
    ap.add_argument("--golden", action="store_true", help=f"write the golden cells' hashes to {GOLDEN_PATH}")
    args = ap.parse_args()
    if args.golden:
        return write_golden()
    golden = json.loads(Path(args.check).read_text())["cells"] if args.check else None
    out, changed = {}, []
    worlds = [int(w) for w in args.worlds.split(",")]
    todo = list(cells(worlds, args.budgets.split(","), args.scenarios.split(","), args.distributions, args.ring))
    for i, cell in enumerate(todo):
        if golden is not None and cell.key not in golden:
            continue
        got = out[cell.key] = cell_hashes(cell, args.policy, args.steps)
        mark = "" if golden is None else compare(cell.key, golden[cell.key], got)
        if mark:
            changed.append(cell.key)
        print(f"[{i + 1}/{len(todo)}] {cell.key}: {got['hash']} ({got['cpu_s']:.1f} CPU s){mark}", file=sys.stderr)
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
