"""How much of a scale-report cell's distance from its bound a different dealing of the small
samples closes (`plan.research.refill`): per step, the bound, `dcp`'s plan, the per-sample
packing, its `one_shape` refill (a plan the runtime runs) and the `mixed` what-if (small
samples of any shape added to other micro-batches: the runtime's video collate refuses it),
each simulated, with its CPU ms.

    PYTHONPATH=. .venv/bin/python benchmarks/refill_probe.py strong:256:video:video-mix strong:256:video:image-buckets

A cell is budget:world:scenario:distribution; its steps are formed as `sim_scale.py` forms
them (`--max-steps`, default 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_scale import cell_workload  # noqa: E402

from dcparallel.cost.analytic import AnalyticCost  # noqa: E402
from dcparallel.plan.bounds import LowerBound  # noqa: E402
from dcparallel.plan.context import PlanContext  # noqa: E402
from dcparallel.plan.dcp.sample import SamplePacker  # noqa: E402
from dcparallel.plan.policies import make_planner  # noqa: E402
from dcparallel.plan.research.refill import refill  # noqa: E402
from dcparallel.plan.steps import form_steps  # noqa: E402
from dcparallel.scenarios import SCENARIOS  # noqa: E402
from dcparallel.sim.replay import simulate, step_seconds  # noqa: E402


def cell_steps(budget: str, world: int, scenario: str, dist: str, max_steps: int):
    """The cell's context and steps, as `sim_scale.run_cell` forms them."""
    sc = SCENARIOS[scenario]
    tps = max(sc.tokens_per_step * world // 32 if budget == "weak" else sc.tokens_per_step, 1)
    wl = cell_workload(scenario, dist, tps, 2)
    cl = sc.cluster(world)
    ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
    return ctx, form_steps(wl.tokens, seed=0, tokens_per_step=tps)[:max_steps]


def timed(fn, *args):
    c = time.process_time()
    out = fn(*args)
    return out, (time.process_time() - c) * 1e3


def simulated(ctx, step, plan) -> float:
    """The plan's simulated step time, after checking it (valid, every sample once, memory)."""
    plan.validate(ctx.cluster.world_size)
    assert sorted(i for mb in plan.micro_batches() for i in mb.sample_ids) == sorted(step.sample_ids)
    sim = simulate([plan], ctx)
    assert sim.memory_violations == 0
    return sim.total_time


def probe(cell: str, max_steps: int) -> list[str]:
    budget, world, scenario, dist = cell.split(":")
    ctx, steps = cell_steps(budget, int(world), scenario, dist, max_steps)
    lb = LowerBound(ctx)
    dcp = make_planner("dcp", ctx, steps, score=step_seconds(ctx))
    rows = []
    for x, step in enumerate(steps):
        bound = lb.step(step)
        dcp.plan(step)  # fills its caches
        plan, dcp_ms = timed(dcp.plan, step)
        packer = SamplePacker(ctx, "pac")
        ids = list(step.sample_ids)
        packer.plan(ids)  # fills its caches
        packing, pack_ms = timed(packer.plan, ids)
        cols = [f"{bound:.4f}", f"{simulated(ctx, step, plan):.4f} ({dcp_ms:.0f})"]
        cols.append(f"{simulated(ctx, step, packer.step_plan(step, packing.groups)):.4f} ({pack_ms:.0f})")
        for mixed in (False, True):
            got, ms = timed(refill, packer, ids, packing, mixed)
            t = packing.span if got is None else simulated(ctx, step, packer.step_plan(step, got.groups))
            cols.append(f"{t:.4f}{'' if got else ' (none faster)'} ({ms:.0f})")
        rows.append(f"| {cell} | {x} | {len(ids) / int(world):.1f} | " + " | ".join(cols) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cells", nargs="+", help="budget:world:scenario:distribution")
    ap.add_argument("--max-steps", type=int, default=2)
    args = ap.parse_args()
    print(
        "| cell | step | samples/GPU | bound s | dcp s (ms) | packing s (ms) | one-shape refill s (ms) "
        "| mixed what-if s (ms) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell in args.cells:
        for row in probe(cell, args.max_steps):
            print(row, flush=True)


if __name__ == "__main__":
    main()
