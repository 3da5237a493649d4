"""`dcp` planning cost per step as CPU time of this process (`time.process_time`), which other
jobs on a shared machine inflate far less than wall-clock time.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_cpu_time.py --world 1024 --budget weak [--cells text/short,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import DISTRIBUTIONS, EPOCH_STEPS, SCENARIOS, sample_sizes
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import Workload


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--budget", choices=("weak", "strong"), default="weak")
    ap.add_argument("--cells", default=",".join(f"{s}/{d}" for s in SCENARIOS for d in DISTRIBUTIONS))
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    for item in args.cells.split(","):
        sc_name, d = item.split("/")
        sc = SCENARIOS[sc_name]
        tps = sc.tokens_per_step * args.world // 32 if args.budget == "weak" else sc.tokens_per_step
        wl = Workload(sc.model, tuple(sample_sizes(sc_name, d, epoch_tokens=max(EPOCH_STEPS * sc.tokens_per_step,
                                                                                  args.steps * tps))))
        cl = sc.cluster(args.world)
        ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
        steps = form_steps(wl.tokens, seed=0, tokens_per_step=tps)[: args.steps]
        planner = make_planner("dcp", ctx, steps, score=step_seconds(ctx))
        cpu, wall = [], []
        for s in steps:
            c0, w0 = time.process_time(), time.perf_counter()
            planner.plan(s)
            cpu.append((time.process_time() - c0) * 1e3)
            wall.append((time.perf_counter() - w0) * 1e3)
        n = statistics.median(len(s.sample_ids) for s in steps)
        print(f"{args.budget} {args.world} {item}: {len(steps)} steps, {n} samples/step; "
              f"CPU ms median {statistics.median(cpu):.1f} max {max(cpu):.1f}; "
              f"wall ms median {statistics.median(wall):.1f} max {max(wall):.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
