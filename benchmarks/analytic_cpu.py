"""`cost = "analytic"` on CPU: the step times it predicts against the step times measured,
with this CPU's calibration (`profile.cpu_calibration`) and with the packaged H200 one.

    .venv/bin/python benchmarks/analytic_cpu.py [--steps 8] [--policies dcp bucket packed]

The demo's configuration (`dcparallel demo`: its 4-layer reference LM, its 420 skewed
lengths of 32 to 3072 tokens, 16,384 tokens a step) trained through the public API
(`DataCentricParallel(model, policy=...)`, `prepare(..., cost="analytic", predict=True)`),
one torchrun launch of 2 gloo ranks with one thread each per policy, no memory limit. Each
step's time is measured on rank 0 from a barrier to the end of `sync_gradients` (the
optimizer step, which no prediction includes, is left out) and set against the loader's
prediction of the same plan (`LoaderStep.predicted.step_s`, CPU calibration) and the same
plan priced by the H200 calibration. The first step of each run (first-time allocations)
is reported but not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch

    import dcparallel
    from dcparallel.apps.demo_worker import demo_model
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.data.synthetic import SyntheticText, builtin_lengths
    from dcparallel.loss import per_token_loss
    from dcparallel.plan.context import PlanContext
    from dcparallel.runtime.auto_launch import priced_cluster
    from dcparallel.sim.replay import predict_step
    from dcparallel.spec import Workload

    torch.set_num_threads(1)
    lengths = builtin_lengths()
    model = demo_model(4)

    def loss_fn(model, batch, ctx):
        ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
        return ctx.token_loss(ptl, batch.loss_mask)

    dc = dcparallel.DataCentricParallel(model, policy=args.policy)
    t0 = time.perf_counter()
    loader = dc.prepare(SyntheticText(lengths), lengths=lengths, tokens_per_step=16384, cost="analytic",
                        profile_path=Path(args.out) / "profile.json", loss_fn=loss_fn, predict=True)
    prepare_s = time.perf_counter() - t0
    cluster = priced_cluster(dc.cluster_spec)
    h200 = PlanContext(Workload(dc.spec, tuple(lengths)), AnalyticCost(dc.spec, cluster), cluster)
    opt = dc.optimizer(lr=1e-3)
    rows = []
    for step in loader:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for batch in step:
            with dc.micro_batch(batch) as ctx:
                ctx.backward(loss_fn(model, batch, ctx))
        dc.sync_gradients()
        measured = time.perf_counter() - t0
        opt.step()
        rows.append({"step": step.index, "measured_s": measured, "cpu_s": step.predicted.step_s,
                     "h200_s": predict_step(step.plan, h200).step_s,
                     "sp": sorted({g.sp for g in step.plan.groups_of(0)})})
        if len(rows) == args.steps:
            break
    loader.close()
    if dc.rank == 0:
        (Path(args.out) / f"{args.policy}.json").write_text(json.dumps({"prepare_s": prepare_s, "steps": rows}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=["dcp", "bucket", "packed"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    out = Path(tempfile.mkdtemp(prefix="analytic-cpu-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for policy in args.policies:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--worker", "--policy", policy, "--out", str(out), "--steps", str(args.steps)]
        subprocess.run(cmd, env=env, check=True)
    print("| policy | step | SP | measured s | CPU calibration s (error) | H200 calibration s (error) |")
    print("| --- | --- | --- | --- | --- | --- |")
    summary = []
    for policy in args.policies:
        res = json.loads((out / f"{policy}.json").read_text())
        for r in res["steps"]:
            m = r["measured_s"]
            print(f"| {policy} | {r['step']} | {r['sp']} | {m:.2f} | {r['cpu_s']:.2f} ({r['cpu_s'] / m - 1:+.0%}) "
                  f"| {r['h200_s']:.3f} ({r['h200_s'] / m - 1:+.0%}) |")
        counted = res["steps"][1:]
        cpu = statistics.median(abs(r["cpu_s"] / r["measured_s"] - 1) for r in counted)
        worst = max(abs(r["cpu_s"] / r["measured_s"] - 1) for r in counted)
        total = sum(r["cpu_s"] for r in counted) / sum(r["measured_s"] for r in counted) - 1
        h200 = statistics.median(abs(r["h200_s"] / r["measured_s"] - 1) for r in counted)
        summary.append(f"| {policy} | {res['prepare_s']:.1f} | {cpu:.0%} | {worst:.0%} | {total:+.0%} | {h200:.0%} |")
    print("\n| policy | prepare s (calibration) | CPU: median abs error | CPU: worst | CPU: sum of steps | "
          "H200: median abs error |\n| --- | --- | --- | --- | --- | --- |")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
