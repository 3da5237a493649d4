"""How far `dcp` is from the step bound on the realistic mixes (`scenarios.MIXES`), and
whether the bound or the plan is loose: per step, `dcp`'s simulated time against the
library's bound (`LowerBound.step`), the tight bound and the midpoint bound computed on
every step (`benchmarks/tight_bound.py`; the library computes the midpoint only for steps of
few samples per GPU), and, as a reference plan, `packed`.

    PYTHONPATH=. .venv/bin/python benchmarks/mixes_gap.py --worlds 256,1024 --steps 2 \\
        [--cells video/video-mix,video/video-wide,text/sft-long,text/pretrain-long]

Weak budget: the scenario's tokens per step x world / 32. Prints one line per cell.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.tight_bound import TightBound
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import SCENARIOS, distinct_shapes, sample_sizes
from dcparallel.sim.replay import replay_step, step_seconds
from dcparallel.spec import Workload


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="256,1024")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cells", default="video/video-mix,video/video-wide,text/sft-long,text/pretrain-long")
    ap.add_argument("--policies", default="dcp,packed")
    args = ap.parse_args()
    for world in [int(w) for w in args.worlds.split(",")]:
        for cell in args.cells.split(","):
            sc_name, dist = cell.split("/")
            sc = SCENARIOS[sc_name]
            tps = sc.tokens_per_step * world // 32
            wl = Workload(sc.model, tuple(sample_sizes(sc_name, dist, epoch_tokens=(args.steps + 1) * tps)))
            cl = sc.cluster(world)
            ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
            steps = form_steps(wl.tokens, seed=0, tokens_per_step=tps)[: args.steps]
            lb, tb = LowerBound(ctx), TightBound(ctx)
            bound = [lb.step(s) for s in steps]
            best = [max(b, tb.midpoint_step(s)) for b, s in zip(bound, steps)]
            shapes = statistics.median(distinct_shapes(sc.model, [wl.sizes[i] for i in s.sample_ids]) for s in steps)
            line = (
                f"{world} {cell}: {len(steps)} steps, {statistics.median(len(s.sample_ids) for s in steps)} "
                f"samples/step, {shapes} shapes/step; midpoint/library bound "
                f"{sum(best) / sum(bound):.4f}"
            )
            for name in args.policies.split(","):
                planner = make_planner(name, ctx, steps, score=step_seconds(ctx))
                times = [replay_step(planner.plan(s), ctx).step_time for s in steps]
                line += (
                    f"; {name} efficiency {sum(bound) / sum(times):.4f} (vs midpoint "
                    f"{sum(best) / sum(times):.4f}, worst step {min(b / t for b, t in zip(bound, times)):.4f})"
                )
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
