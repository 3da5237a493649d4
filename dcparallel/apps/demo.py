"""`dcparallel demo`: real training per policy here, predicted by the simulator, and paper scale.

Real training on this machine, side by side per policy, predicted by the simulator, next to
the paper-scale simulation; the first comparison comes after one round of training, refined
by every later round.

1. A skewed-length dataset of real token sequences (or `--lengths FILE`).
2. One `torchrun` launch, 2 gloo ranks with one thread each (`dcparallel.apps.demo_worker`):
   profile the tiny LM at world 2 within `--profile-budget` seconds (cached in the output
   folder), plan every policy's epoch with the simulator and print the plans, warm up every
   SP degree and recompute path, then train the same samples in the same steps per policy
   (bucket, packed, dcp; `--repeats` rounds of one timed run of every policy, interleaved,
   the median timed run counts), timing the training loop only; after the first round, one
   untimed run of every policy calibrates the predictions. After every round the worker
   prints the comparison so far with the runs it rests on. A per-rank
   memory budget, derived from the profile so that the longest sample needs SP = 2 *and*
   recomputation (as a device's memory would force), makes the run use all three levers.
3. Each run is predicted by the simulator from the same profile (`demo_predict`), scaled by
   the factor the worker measured on the untimed runs (how many times its price each
   micro-batch took there, pooled over every policy; `training_factor`); the first
   comparison, printed before the untimed runs, shows the predictions at the profile's prices.
4. The paper-scale scenarios are simulated (32 GPUs, every scenario x distribution) in two
   processes, after the training launch so that they do not share its cores.
5. `report.md`, PNG plots and a summary table (`dcparallel.apps.demo_report`), with the spread
   of each policy's repeats, a plain warning when it is too large for the comparison to mean
   anything, and the wall and processor seconds of each phase (``phase_s``, ``phase_cpu_s`` in
   summary.json); `--json` prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from dcparallel.apps.demo_predict import predict, prediction_errors
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
REPEATS = 3
#: the profile's wall-time budget in seconds (`ProfilerConfig.budget_s`, `profile.budget`)
PROFILE_BUDGET_S = 60.0


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
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.profile_budget <= 0:
        raise ValueError(f"--profile-budget must be a positive number of seconds, got {args.profile_budget}")
    started = time.time()
    t_demo = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths, source = _lengths(args)
    _check_fits(lengths, args.layers)
    (out / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    launch_s = _launch(args, out, len(lengths))
    real = json.loads((out / "real.json").read_text())
    t0, c0 = time.perf_counter(), _cpu_s()
    simulated = []
    if not args.skip_paper_scale:
        print(f"[demo] simulating the paper-scale scenarios in {WORLD} processes ...", file=sys.stderr)
        simulated = paper_scale(workers=WORLD)
    t1, c1 = time.perf_counter(), _cpu_s()
    artifacts = _plots(out, real, simulated)
    summary = _summary(real, source, len(lengths), simulated)
    summary["phase_s"] = {
        **real["phase_s"],
        "launch": launch_s,
        "paper_scale": t1 - t0,
        "plots": time.perf_counter() - t1,
    }
    summary["phase_cpu_s"] = {**real["phase_cpu_s"], "paper_scale": c1 - c0, "plots": _cpu_s() - c1}
    summary["launch_s"] = launch_s
    summary["first_result_s"] = real["first_comparison_at"] - started
    summary["demo_s"] = time.perf_counter() - t_demo
    report = write_report(out, summary, predict(real), summary["errors"], real)
    summary["artifacts"] = [str(a) for a in [report, *artifacts]]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _cpu_s() -> float:
    """Processor seconds of this process and of its children that ended (the paper-scale
    simulation's worker processes)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _lengths(args: argparse.Namespace) -> tuple[list[int], str]:
    """The samples' token counts (``--lengths`` or the built-in skewed set) and what they are."""
    from dcparallel.data.synthetic import builtin_lengths
    from dcparallel.scenarios import read_lengths

    if not args.lengths:
        return builtin_lengths(), "built-in skewed (70% 32-256, 24% 256-1024, 6% 1024-3072 tokens)"
    lengths = read_lengths(args.lengths)
    if any(isinstance(s, tuple) for s in lengths):
        raise ValueError(f"{args.lengths}: the demo trains a text model; give token counts, one per line")
    return lengths, Path(args.lengths).name


def _launch(args: argparse.Namespace, out: Path, num_samples: int) -> float:
    """The training launch (`demo_worker`), its output on stderr; returns its seconds."""
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
        "--profile-budget",
        str(args.profile_budget),
        "--policies",
        *POLICIES,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(f"[demo] training {num_samples} samples on {WORLD} gloo ranks: {' '.join(POLICIES)}", file=sys.stderr)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the training launch failed with exit code {proc.returncode}: {' '.join(cmd)}")
    return time.perf_counter() - t0


def _plots(out: Path, real: dict, simulated: list[dict]) -> list[Path]:
    """The real runs' timeline (bucket vs dcp) and, with the paper-scale results, their plots."""
    from dcparallel.report.plots import plot_paper_scale_timeline, plot_speedups, plot_timelines

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
    return artifacts


#: what the summary keeps of each policy's counted run
RUN_KEYS = ("wall_s", "tokens_per_s", "steps", "samples", "samples_hash", "loss_first", "loss_last")
#: what the summary keeps of each policy's prediction
PREDICTED_KEYS = ("wall_s", "wall_s_profile", "factor", "idle_fraction", "speed", "wall_s_at_run_speed")


def _summary(real: dict, source: str, num_samples: int, simulated: list[dict]) -> dict:
    """summary.json (and what the report and table print): the real runs with their spread,
    the predictions and their errors (scaled by the training factor, at the profile's prices,
    at the runs' speed), the notes on what the timings cannot support, the paper scale."""
    from dcparallel.apps.demo_worker import MODEL
    from dcparallel.apps.presets import LLAMAS

    p = real["policies"]
    pred = predict(real)
    errors, errors_profile, errors_at_speed = (
        prediction_errors(pred, real, key) for key in ("wall_s", "wall_s_profile", "wall_s_at_run_speed")
    )
    return {
        "real": {
            "world": real["world"],
            "memory_budget_bytes": real["memory_budget_bytes"],
            "budget_rule": real["budget_rule"],
            "lengths": source,
            "samples_total": num_samples,
            "repeats": real["repeats"],
            "policies": {
                n: {**{k: v[k] for k in RUN_KEYS}, "wall_s_runs": v["walls"], "spread": spread(v["walls"])}
                for n, v in p.items()
            },
            "speedup": p["bucket"]["wall_s"] / p["dcp"]["wall_s"],
            "speedup_vs_packed": p["packed"]["wall_s"] / p["dcp"]["wall_s"],
        },
        "predicted": {n: {k: v[k] for k in PREDICTED_KEYS if k in v} for n, v in pred.items()},
        "errors": errors,
        "training_factor": real["training_factor"],
        "prediction_error": max(errors.values()),
        "prediction_error_at_profile_prices": max(errors_profile.values()),
        "prediction_error_at_run_speed": max(errors_at_speed.values()) if errors_at_speed else None,
        "trust_notes": trust_notes({n: v["walls"] for n, v in p.items()}, errors),
        "simulated": simulated,
        "profile_s": real["profile_s"],
        "profile_reused": real["profile_reused"],
        "vocab": LLAMAS[MODEL].vocab_size,
        "artifacts": [],
    }


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
    p.add_argument(
        "--profile-budget",
        type=float,
        default=PROFILE_BUDGET_S,
        help="wall-time budget of the profile in seconds: the largest buckets are measured coarsely when "
        "the rest would not fit (default %(default)s; a cached profile is reused)",
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
