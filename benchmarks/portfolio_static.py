"""`dcp` against the static layouts it offers (`plan/dcp/static.py`), on the cases of
`tests/unit/test_dcp_static.py` (7M-parameter Llama and DiT to 70B, heavy-tailed mixes): per
case the simulated seconds of the first steps under `dcp`, its portfolio without the static
layouts (`DcpPlanner(ctx, score)`: what `dcp` planned before they were offered), `bucket`
and `packed`, and the median CPU ms per step of `dcp` and of the portfolio without them.

    PYTHONPATH=. .venv/bin/python benchmarks/portfolio_static.py [--steps 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.auto_shard import auto_shard_size
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.portfolio import DcpPlanner
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import Workload, h200_cluster
from tests.unit.test_dcp_static import CASES, _mix


def run_case(model, sizes, world: int, tps: int, num_steps: int) -> dict:
    cluster = h200_cluster(world, min(world, 8))
    cluster = dataclasses.replace(cluster, shard_size=auto_shard_size(model, cluster, sizes))
    ctx = PlanContext(Workload(model, sizes), AnalyticCost(model, cluster), cluster)
    steps = form_steps(ctx.workload.tokens, seed=0, tokens_per_step=tps)[:num_steps]
    score = step_seconds(ctx)
    planners = {
        "dcp": make_planner("dcp", ctx, steps, score=score),
        "class level": DcpPlanner(ctx, score),
        "bucket": make_planner("bucket", ctx, steps, score=score),
        "packed": make_planner("packed", ctx, steps, score=score),
    }
    out = {"steps": len(steps), "shard": cluster.shard_size}
    for name, p in planners.items():
        secs, ms = 0.0, []
        for s in steps:
            c0 = time.process_time()
            plan = p.plan(s)
            ms.append((time.process_time() - c0) * 1e3)
            secs += score(plan)
        out[name] = secs
        out[f"{name} ms"] = statistics.median(ms)
    out["kept_by"] = planners["dcp"].describe().get("kept_by", {})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    print(
        "| model | params | mix | GPUs | shard | steps | dcp / best static | class level alone / best static | "
        "dcp ms | class level ms | dcp steps kept from |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model, mix, n, world, tps in CASES:
        r = run_case(model, _mix(model, mix, n), world, tps, args.steps)
        best = min(r["bucket"], r["packed"])
        kept = ", ".join(f"{k} {v}" for k, v in r["kept_by"].items())
        print(
            f"| {model.name} | {model.num_params / 1e9:.3g}B | {mix} | {world} | {r['shard']} | {r['steps']} | "
            f"{r['dcp'] / best:.3f} | {r['class level'] / best:.3f} | {r['dcp ms']:.1f} | "
            f"{r['class level ms']:.1f} | {kept} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
