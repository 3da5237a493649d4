"""`dcparallel demo`: real training per policy here, predicted by the simulator, and paper scale.

Real training on this machine, side by side per policy, predicted by the simulator, next to
the paper-scale simulation.

1. A skewed-length dataset of real token sequences (or `--lengths FILE`).
2. One `torchrun` launch, 2 gloo ranks with one thread each (`dcparallel.apps.demo_worker`):
   profile the tiny LM at world 2, warm up every SP degree and recompute path, then train the
   same samples in the same steps per policy (bucket, packed, dcp; `--repeats` runs each,
   interleaved, the median counts), timing the training loop only. A per-rank memory budget,
   derived from the profile so that the longest sample needs SP = 2 *and* recomputation (as a
   device's memory would force), makes the run use all three levers.
3. Each run is predicted by the simulator from the same profile, scaled by the factor the
   worker measured on untimed runs, one of every policy before each timed round (how many
   times its price each micro-batch took there, pooled; `training_factor`).
4. The paper-scale scenarios are simulated (32 GPUs, every scenario x distribution).
5. `report.md`, PNG plots and a summary table (`dcparallel.apps.demo_report`), with the spread
   of each policy's repeats and a plain warning when it is too large for the comparison to
   mean anything; `--json` prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from dcparallel.apps.demo_report import print_table, rank_timelines, spread, trust_notes, write_report
from dcparallel.apps.simulate import paper_scale
from dcparallel.apps.train_inputs import check_fits
from dcparallel.plan.policies import COMPARED

#: the user policies, baselines first
POLICIES = COMPARED
TOKENS_PER_STEP = 16384
#: gloo ranks the demo launches
WORLD = 2
#: timed runs per policy (interleaved); each policy's median run is compared (`demo_worker.counted_run`)
REPEATS = 5


def predict(out: Path, lengths: list[int], real: dict) -> dict[str, dict]:
    """Simulated wall time of each policy's run from the same profile and budget: the plans'
    compute + gradient sync times the measured `training_factor`, plus the optimizer step
    measured before training (``wall_s_profile``: at the profile's prices, unscaled)."""
    from dcparallel.apps.demo_worker import SEED
    from dcparallel.cost.profiled import ProfiledCost
    from dcparallel.cost.schema import Profile
    from dcparallel.plan.context import PlanContext
    from dcparallel.plan.steps import form_steps
    from dcparallel.sim.run import plan_epoch
    from dcparallel.spec import Workload

    profile = Profile.load(out / "profile.json")
    cluster = budget_cluster(real)
    ctx = PlanContext(Workload(profile.model, tuple(lengths)), ProfiledCost(profile, cluster), cluster)
    steps = form_steps(ctx.tokens, seed=SEED, tokens_per_step=real["tokens_per_step"])
    factor = real.get("training_factor", 1.0)
    pred = {}
    for name in real["policies"]:
        run = plan_epoch(ctx, steps, name)
        optimizer = len(steps) * real["optimizer_step_s"]
        pred[name] = {
            "wall_s": run.sim.total_time * factor + optimizer,
            "wall_s_profile": run.sim.total_time + optimizer,
            "factor": factor,
            "idle_fraction": run.sim.idle_fraction,
            "settings": {k: v for k, v in run.settings.items() if k != "tried_s"},
        }
        ref = real["policies"][name].get("reference_s")
        if ref and profile.reference_s:  # the machine's speed during the run, against the profile's
            pred[name]["speed"] = ref / profile.reference_s
            pred[name]["wall_s_at_run_speed"] = pred[name]["wall_s_profile"] * pred[name]["speed"]
    return pred


def budget_cluster(real: dict):
    """The cluster a demo run trained on (real.json): its world on one node, its memory budget per rank."""
    from dcparallel.spec import ClusterSpec

    return ClusterSpec(
        world_size=real["world"],
        gpus_per_node=real["world"],
        memory_bytes=real["memory_budget_bytes"],
        name="cpu-budget",
    )


def prediction_errors(pred: dict, real: dict, key: str) -> dict[str, float]:
    """Per policy with a prediction under `key`: abs(predicted - measured) / measured."""
    return {n: abs(pred[n][key] - v["wall_s"]) / v["wall_s"] for n, v in real["policies"].items() if key in pred[n]}


def _check_fits(lengths: list[int], num_layers: int) -> None:
    """A sample far beyond this machine's memory is refused here, with the planner's message,
    before torchrun starts (inside, the profiler would die on a raw allocator error)."""
    from dcparallel.apps.demo_worker import demo_model
    from dcparallel.profile.inputs import reference_spec

    model = demo_model(num_layers)
    spec, _ = reference_spec(model, model.layers)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // WORLD
    check_fits(spec, lengths, WORLD, WORLD, memory)


def run(args: argparse.Namespace) -> dict:
    from dcparallel.apps.demo_worker import MODEL
    from dcparallel.apps.presets import LLAMAS
    from dcparallel.data.synthetic import builtin_lengths
    from dcparallel.report.plots import plot_paper_scale_timeline, plot_speedups, plot_timelines
    from dcparallel.scenarios import read_lengths

    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    t_demo = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.lengths:
        lengths = read_lengths(args.lengths)
        if any(isinstance(s, tuple) for s in lengths):
            raise ValueError(f"{args.lengths}: the demo trains a text model; give token counts, one per line")
        source = Path(args.lengths).name
    else:
        lengths = builtin_lengths()
        source = "built-in skewed (70% 32-256, 24% 256-1024, 6% 1024-3072 tokens)"
    _check_fits(lengths, args.layers)
    (out / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        "-m",
        "dcparallel.apps.demo",
        "--worker",
        "--out",
        str(out),
        "--layers",
        str(args.layers),
        "--tokens-per-step",
        str(args.tokens_per_step),
        "--repeats",
        str(args.repeats),
        "--policies",
        *POLICIES,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(f"[demo] training {len(lengths)} samples on {WORLD} gloo ranks: {' '.join(POLICIES)}", file=sys.stderr)
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the training launch failed with exit code {proc.returncode}: {' '.join(cmd)}")
    launch_s = time.perf_counter() - t0
    real = json.loads((out / "real.json").read_text())
    pred = predict(out, lengths, real)
    errors, errors_profile, errors_at_speed = (
        prediction_errors(pred, real, key) for key in ("wall_s", "wall_s_profile", "wall_s_at_run_speed")
    )
    simulated = []
    if not args.skip_paper_scale:
        print("[demo] simulating the paper-scale scenarios ...", file=sys.stderr)
        simulated = paper_scale()
    p = real["policies"]
    artifacts = [
        plot_timelines(
            rank_timelines(real, ("bucket", "dcp")),
            out / "timeline.png",
            title=f"real run on {WORLD} CPU ranks: bucket vs dcp (busy / idle per rank)",
        )
    ]
    if simulated:
        artifacts.append(plot_speedups(simulated, out / "speedups.png"))
        artifacts.append(plot_paper_scale_timeline(out / "timeline_paper_scale.png"))
    summary = {
        "real": {
            "world": real["world"],
            "memory_budget_bytes": real["memory_budget_bytes"],
            "budget_rule": real["budget_rule"],
            "lengths": source,
            "samples_total": len(lengths),
            "repeats": real["repeats"],
            "policies": {
                n: {
                    **{
                        k: v[k]
                        for k in (
                            "wall_s",
                            "tokens_per_s",
                            "steps",
                            "samples",
                            "samples_hash",
                            "loss_first",
                            "loss_last",
                        )
                    },
                    "wall_s_runs": v["walls"],
                    "spread": spread(v["walls"]),
                }
                for n, v in p.items()
            },
            "speedup": p["bucket"]["wall_s"] / p["dcp"]["wall_s"],
            "speedup_vs_packed": p["packed"]["wall_s"] / p["dcp"]["wall_s"],
        },
        "predicted": {
            n: {
                k: v[k]
                for k in ("wall_s", "wall_s_profile", "factor", "idle_fraction", "speed", "wall_s_at_run_speed")
                if k in v
            }
            for n, v in pred.items()
        },
        "training_factor": real.get("training_factor", 1.0),
        "prediction_error": max(errors.values()),
        "prediction_error_at_profile_prices": max(errors_profile.values()),
        "prediction_error_at_run_speed": max(errors_at_speed.values()) if errors_at_speed else None,
        "trust_notes": trust_notes({n: v["walls"] for n, v in p.items()}, errors),
        "simulated": simulated,
        "profile_s": real["profile_s"],
        "profile_reused": real["profile_reused"],
        "launch_s": launch_s,
        "vocab": LLAMAS[MODEL].vocab_size,
        "artifacts": [],
    }
    summary["demo_s"] = time.perf_counter() - t_demo
    report = write_report(out, summary, pred, errors, real)
    summary["artifacts"] = [str(a) for a in [report, *artifacts]]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo_out", help="output folder (report, plots, profile cache)")
    p.add_argument("--lengths", default=None, help="token counts, one per line, instead of the built-in data")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP)
    p.add_argument(
        "--repeats",
        type=int,
        default=REPEATS,
        help="timed runs per policy, interleaved; each policy's median counts, all are reported with "
        "their spread (default %(default)s; raise it on a busy machine)",
    )
    p.add_argument("--skip-paper-scale", action="store_true", help="do not simulate the paper-scale scenarios")
    p.add_argument("--json", action="store_true", help="one JSON object on one line, last on stdout")


def cmd_demo(args: argparse.Namespace) -> int:
    s = run(args)
    if args.json:
        print(json.dumps(s))
    else:
        print_table(s)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, default=3e-3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    if args.worker:
        from dcparallel.apps.demo_worker import worker

        return worker(args)
    return cmd_demo(args)


if __name__ == "__main__":
    sys.exit(main())
