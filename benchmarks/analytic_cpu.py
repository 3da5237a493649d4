"""`cost = "analytic"` on CPU: the step times it predicts against the step times measured,
with this CPU's calibration (`profile.cpu_calibration`: the layer's constants and the launch's
links, `profile.cpu_links`), with the same layer constants on GPU link speeds, and with the
packaged H200 one.

    .venv/bin/python benchmarks/analytic_cpu.py [--steps 8] [--policies dcp bucket packed] [--out DIR]
    .venv/bin/python benchmarks/analytic_cpu.py --calibrations 4 --gap 60

The demo's configuration (`dcparallel demo`: its 4-layer reference LM, its 420 skewed
lengths of 32 to 3072 tokens, 16,384 tokens a step) trained through the public API
(`DataCentricParallel(model, policy=...)`, `prepare(..., cost="analytic", predict=True)`),
one torchrun launch of 2 gloo ranks with one thread each per policy, each launch timing its
own calibration (a cache folder per policy), no memory limit. Each
step's time is measured on rank 0 from a barrier to the end of `sync_gradients` (the
optimizer step, which no prediction includes, is left out), and so is each micro-batch and
the sync; each is set against the same plan's prices (`LoaderStep.predicted.step_s`, the
cost model's micro-batch terms and gradient sync), and against the same plan priced with one
cost per attention pair at every document length (`Calibration.attn_knots` left out). Each
step's micro-batch times are fed to `loader.observe`, which keeps the slowdown current
(`data.refine.track_steps`): `predicted` is priced at the slowdown tracked over the steps
before it, and the same plan is also priced at the launch's slowdown (untracked). Rank 0's
micro-batches are split into the all-to-alls' transfer, their wait for the other rank, and the
compute (the rest), each against its price.
The first step of each run (first-time allocations) is reported but not counted. ``--out DIR``
reprints an earlier run's tables.

``--calibrations K``: how the layer calibration repeats instead: K calibrations of the demo's
model in one process (one thread), ``--gap`` seconds apart, each constant and its spread
(largest / smallest - 1): the constants in wall seconds (what prices a step), the share of a
core the process had, and the constants in processor seconds (before the share).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _record_alltoalls(calls: list) -> None:
    """Every ``all_to_all_single`` from now on appends (start, end, bytes) to ``calls``: the
    runtime's Ulysses all-to-alls (`runtime.comm`), timed where the rank enters and leaves
    them (`time.perf_counter`: one clock for every process of the machine)."""
    import torch.distributed as dist

    inner = dist.all_to_all_single

    def timed(out, inp, *a, **kw):
        t0 = time.perf_counter()
        r = inner(out, inp, *a, **kw)
        calls.append((t0, time.perf_counter(), inp.numel() * inp.element_size()))
        return r

    dist.all_to_all_single = timed


def split_alltoalls(mine: list, every: list) -> tuple[float, float]:
    """(transfer, wait) seconds of this rank's all-to-alls ``mine`` in a micro-batch, each
    paired by order with every rank's same call (``every``: per rank, its calls; an
    all-to-all returns only once every rank has entered it): the wait is the time from
    entering until the last rank entered, the transfer the rest."""
    transfer = wait = 0.0
    for i, (t0, t1, _) in enumerate(mine):
        last = max(calls[i][0] for calls in every)
        wait += max(0.0, min(last, t1) - t0)
        transfer += t1 - max(t0, min(last, t1))
    return transfer, wait


def worker(args: argparse.Namespace) -> None:
    import torch

    import dcparallel
    from dcparallel.apps.demo_worker import demo_model
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.cost.heads import layer_a2a_calls
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

    dc = dcparallel.DataCentricParallel(model, policy=args.policy, research=True)
    load = [os.getloadavg()[0]]  # the machine's 1-minute load average, before and after
    t0 = time.perf_counter()
    loader = dc.prepare(
        SyntheticText(lengths),
        lengths=lengths,
        tokens_per_step=16384,
        cost="analytic",
        profile_path=Path(args.out) / args.policy / "profile.json",  # each launch calibrates afresh
        loss_fn=loss_fn,
        predict=True,
    )
    prepare_s = time.perf_counter() - t0
    cluster = priced_cluster(dc.cluster_spec)
    work = Workload(dc.spec, tuple(lengths))
    h200 = PlanContext(work, AnalyticCost(dc.spec, cluster), cluster)
    gpu_links = AnalyticCost(dc.spec, cluster, dc.cost.cal)  # this CPU's layer, the GPU links
    untimed_links = PlanContext(work, gpu_links, cluster)
    # the same prices with one cost per attention pair at every length (the model before its knots)
    one_slope = AnalyticCost(dc.spec, dc.cost.cluster, dataclasses.replace(dc.cost.cal, attn_knots=()))
    one_slope_ctx = PlanContext(work, one_slope, dc.cost.cluster)
    launch = PlanContext(work, dc.cost, dc.cost.cluster)  # the launch's slowdown, not tracked
    opt = dc.optimizer(lr=1e-3)
    layer_calls = layer_a2a_calls(dc.spec)
    rows, a2a = [], []
    _record_alltoalls(a2a)
    for step in loader:
        scale = loader.context.cost.scale  # of the steps fed before this one: what planned it
        torch.distributed.barrier()
        t0 = time.perf_counter()
        mbs = []
        for batch in step:
            t1, c1, n1 = time.perf_counter(), time.thread_time(), len(a2a)
            with dc.micro_batch(batch) as ctx:
                ctx.backward(loss_fn(model, batch, ctx))
            sizes, lay = [lengths[i] for i in batch.sample_ids], batch.layout
            mbs.append(
                [
                    time.perf_counter() - t1,
                    dc.cost.terms(sizes, lay.sp).time(lay.recompute),
                    gpu_links.terms(sizes, lay.sp).time(lay.recompute),
                    time.thread_time() - c1,  # this rank's processor seconds
                    [n1, len(a2a)],  # its all-to-alls; (transfer, wait) once every rank's are gathered
                    len(sizes),
                    lay.sp,
                    # the all-to-alls priced: per layer forward, again in backward (and in a recomputed forward)
                    (2 * dc.spec.num_layers + lay.recompute.attn) * layer_calls if lay.sp > 1 else 0,
                ]
            )
        t1 = time.perf_counter()
        dc.sync_gradients()
        measured = time.perf_counter() - t0
        opt.step()
        fed = loader.observe(step, [mb[0] for mb in mbs])  # the plans after it are priced with it
        rows.append(
            {
                "step": step.index,
                "measured_s": measured,
                "cpu_s": step.predicted.step_s,  # at the tracked slowdown the plan was made with
                "launch_s": predict_step(step.plan, launch).step_s,
                "scale": scale,
                "before_s": predict_step(step.plan, untimed_links).step_s,
                "one_slope_s": predict_step(step.plan, one_slope_ctx).step_s,
                "documents": [len(m.sample_ids) for g in step.plan.groups_of(0) for m in g.micro_batches],
                "h200_s": predict_step(step.plan, h200).step_s,
                "mbs": mbs,
                "sync_s": [measured - (t1 - t0), dc.cost.grad_sync_time(), gpu_links.grad_sync_time()],
                "sp": sorted({g.sp for g in step.plan.groups_of(0)}),
            }
        )
        rows[-1]["fed"] = fed
        if len(rows) == args.steps:
            break
    loader.close()
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, a2a)  # one group: every rank's calls in the same order
    for mb in (mb for r in rows for mb in r["mbs"]):
        mine, (i, j) = a2a[mb[4][0] : mb[4][1]], mb[4]
        mb[4] = [*split_alltoalls(mine, [e[i:j] for e in every]), len(mine), sum(c[2] for c in mine)]
    if dc.rank == 0:
        from dcparallel.profile import cpu_calibration as cc

        cal = json.loads((Path(args.out) / args.policy / "cpu-calibration.json").read_text())
        layer = next(c for c in cal.values() if "lin_s_per_token" in c)
        res = {
            "prepare_s": prepare_s,
            "steps": rows,
            "calibration": list(cal.values()),
            # the launch's wall seconds per calibrated processor second (`cpu_calibration.slowdown`)
            "slowdown": dc.cost.cal.lin_s_per_token / cc.calibration(dc.spec, layer).lin_s_per_token,
            "load": load + [os.getloadavg()[0]],
        }
        (Path(args.out) / f"{args.policy}.json").write_text(json.dumps(res))


def calibrations(args: argparse.Namespace) -> None:
    """``--calibrations``: the layer calibration timed ``args.calibrations`` times."""
    import torch

    import dcparallel
    from dcparallel.apps.demo_worker import demo_model
    from dcparallel.profile import cpu_calibration as cc

    torch.set_num_threads(1)
    spec = dcparallel.DataCentricParallel(demo_model(4), policy="dcp").spec
    keys = cc.CONSTANTS
    head = [*keys, *(f"halves' spread {k}" for k in keys), "slowdown", *(f"wall {k}" for k in keys)]
    print(f"{args.calibrations} calibrations {args.gap:.0f} s apart")
    print("| calibration | start s | load | seconds | " + " | ".join(head) + " |\n|" + " --- |" * (4 + len(head)))
    rows, t_start = [], time.perf_counter()
    for i in range(args.calibrations):
        if i:
            time.sleep(args.gap)
        t0, load = time.perf_counter(), os.getloadavg()[0]
        m = cc.measure(spec)  # with its slowdown over its own windows
        m.update({f"halves' spread {k}": m["spread"][k] for k in keys})
        m.update({f"wall {k}": m[k] * m["slowdown"] for k in keys})
        rows.append(m)
        vals = " | ".join(f"{m[k]:.3g}" if "spread" not in k else f"{m[k]:.0%}" for k in head)
        print(f"| {i + 1} | {t0 - t_start:.0f} | {load:.1f} | {time.perf_counter() - t0:.1f} | {vals} |", flush=True)
    spread = " | ".join(
        "" if "spread" in k else f"{max(r[k] for r in rows) / min(r[k] for r in rows) - 1:.0%}" for k in head
    )
    print(f"| spread | | | | {spread} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=["dcp", "bucket", "packed"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--out", help="a folder of earlier results: only print their report")
    p.add_argument("--calibrations", type=int, help="only time the layer calibration this many times")
    p.add_argument("--gap", type=float, default=60.0, help="seconds between two calibrations")
    p.add_argument("--json", help="with --calibrations: also write the rows to this file")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.calibrations:
        return calibrations(args)
    if args.out:
        return report(args.policies, Path(args.out))
    out = Path(tempfile.mkdtemp(prefix="analytic-cpu-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for policy in args.policies:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--worker",
            "--policy",
            policy,
            "--out",
            str(out),
            "--steps",
            str(args.steps),
        ]
        subprocess.run(cmd, env=env, check=True)
    report(args.policies, out)


def _err(pred: float, meas: float) -> str:
    return f"{pred:.2f} ({pred / meas - 1:+.0%})"


def report(policies: list[str], out: Path) -> None:
    """The tables of the report: each step, each policy's summary (the first step not
    counted), and where the time went on rank 0 (micro-batches, gradient sync, the rest)."""
    print(
        "| policy | step | SP | measured s | slowdown priced (launch's) | CPU, tracked slowdown s (error) "
        "| CPU, launch's slowdown s (error) | CPU, GPU links s (error) | H200 s (error) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    summary, terms, calib = [], [], []
    for policy in policies:
        res = json.loads((out / f"{policy}.json").read_text())
        for r in res["steps"]:
            m = r["measured_s"]
            print(
                f"| {policy} | {r['step']} | {r['sp']} | {m:.2f} | {r['scale'] * res['slowdown']:.2f} "
                f"({res['slowdown']:.2f}) | {_err(r['cpu_s'], m)} | {_err(r['launch_s'], m)} "
                f"| {_err(r['before_s'], m)} "
                f"| {r['h200_s']:.3f} ({r['h200_s'] / m - 1:+.0%}) |"
            )
        counted = res["steps"][1:]
        cols = []
        for key in ("cpu_s", "launch_s", "before_s", "one_slope_s"):
            errs = [r[key] / r["measured_s"] - 1 for r in counted]
            total = sum(r[key] for r in counted) / sum(r["measured_s"] for r in counted) - 1
            cols.append(f"{statistics.median(map(abs, errs)):.0%} | {max(map(abs, errs)):.0%} | {total:+.0%}")
        summary.append(f"| {policy} | {res['prepare_s']:.1f} | {' | '.join(cols)} |")
        layer = next(c for c in res["calibration"] if "lin_s_per_token" in c)
        link = next(c for c in res["calibration"] if "bw" in c)
        spread = layer["spread"]
        calib.append(
            f"| {policy} | {res['load'][0]:.1f} - {res['load'][1]:.1f} | {layer['lin_s_per_token']:.3g} "
            f"({spread['lin_s_per_token']:.0%}) | {layer['attn_s_per_pair']:.3g} ({spread['attn_s_per_pair']:.0%}) "
            f"| {layer['floor_s']:.3g} ({spread['floor_s']:.0%}) | {layer['attn_call_s']:.3g} "
            f"({spread['attn_call_s']:.0%}) | {res['slowdown']:.2f} | {link['bw']:.3g} "
            f"| {link['latency']:.3g} |"
        )
        mbs = [mb for r in counted for mb in r["mbs"]]
        mb_m, mb_c, mb_g = (sum(mb[i] for mb in mbs) for i in range(3))
        sync_m, sync_c, sync_g = (sum(r["sync_s"][i] for r in counted) for i in range(3))
        rest = sum(r["measured_s"] for r in counted) - mb_m - sync_m
        mb_err = statistics.median(abs(mb[1] / mb[0] - 1) for mb in mbs)
        terms.append(
            f"| {policy} | {len(mbs)} | {mb_m:.1f} | {_err(mb_c, mb_m)} | {_err(mb_g, mb_m)} | {mb_err:.0%} "
            f"| {sync_m:.2f} | {sync_c:.3f} | {sync_g:.4f} | {rest:.1f} |"
        )
    print(
        "\n| policy | prepare s (calibration) | tracked slowdown: median abs error | worst | sum of steps "
        "| launch's slowdown: median abs error | worst | sum of steps "
        "| GPU links: median abs error | worst | sum of steps | one cost per attention pair: median abs error "
        "| worst | sum of steps |\n|" + " --- |" * 14
    )
    print("\n".join(summary))
    print(
        "\n| policy | rank 0's micro-batches | measured s | CPU, timed links s | CPU, GPU links s | median abs error "
        "of one | sync measured s | sync, timed links s | sync, GPU links s | rest of the steps s |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    print("\n".join(terms))
    print(
        "\n| policy | load average, start - end | processor s per token (halves' spread) | per attention pair "
        "| floor | of which an attention call | slowdown (wall s per processor s) | link bytes/s | link latency s |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    print("\n".join(calib))
    print(
        "\n| policy | SP | rank 0's micro-batches | measured s | all-to-all transfer s | wait s | compute s "
        "(the rest) | compute priced s | processor s | compute priced in processor s | all-to-all priced s "
        "| all-to-alls counted / priced | compute's wall s per processor s (the launch's slowdown) |\n|" + " --- |" * 13
    )
    for policy in policies:
        res = json.loads((out / f"{policy}.json").read_text())
        print("\n".join(parts(policy, res)))


def parts(policy: str, res: dict) -> list[str]:
    """Where rank 0's micro-batch time went, per SP degree, against its priced parts: the
    all-to-alls' transfer and wait (`split_alltoalls`), the compute (the rest) against the
    micro-batch priced on GPU links (its compute), also in processor seconds (the compute
    price over the launch's slowdown), and the all-to-alls' price (the timed links' less
    the GPU links' price); and the compute's wall seconds per processor second against the
    launch's slowdown, which prices it."""
    mbs = [mb for r in res["steps"][1:] for mb in r["mbs"]]
    out = []
    for sp in sorted({mb[6] for mb in mbs}):
        of = [mb for mb in mbs if mb[6] == sp]
        wall, cpu, gpu, proc = (sum(mb[i] for mb in of) for i in range(4))
        transfer, wait, calls = (sum(mb[4][i] for mb in of) for i in range(3))
        priced_calls = sum(mb[7] for mb in of)
        compute = wall - transfer - wait
        out.append(
            f"| {policy} | {sp} | {len(of)} | {wall:.1f} | {transfer:.2f} | {wait:.2f} | {compute:.1f} "
            f"| {_err(gpu, compute)} | {proc:.1f} | {_err(gpu / res['slowdown'], proc)} | {cpu - gpu:.2f} "
            f"| {calls} / {priced_calls} | {compute / proc:.2f} ({res['slowdown']:.2f}) |"
        )
    return out


if __name__ == "__main__":
    main()
