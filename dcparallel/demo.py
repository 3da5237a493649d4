"""`dcparallel demo`: real training on this machine, side by side per policy, predicted by the
simulator, next to the paper-scale simulation.

1. A skewed-length dataset of real token sequences (or `--lengths FILE`).
2. One `torchrun` launch, 2 gloo ranks with one thread each: profile the tiny LM at world 2,
   warm up every SP degree and recompute path, then train the same samples in the same
   steps per policy (bucket, packed, dcp; `--repeats` runs each, interleaved, the fastest
   counts), timing the training loop only. A per-rank memory budget, derived from the profile so
   that the longest sample needs SP = 2 *and* recomputation (as a device's memory would
   force), makes the run use all three levers.
3. Each run is predicted by the simulator from the same profile.
4. The paper-scale scenarios are simulated (32 GPUs, every scenario x distribution).
5. `report.md`, PNG plots and a summary table; `--json` prints one JSON line last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from dcparallel.data.synthetic import SyntheticText, builtin_lengths  # noqa: F401  (the demo's data)

log = logging.getLogger("dcparallel.demo")

POLICIES = ("bucket", "packed", "dcp")
WORLD = 2
VOCAB = 256
SEED = 0
TOKENS_PER_STEP = 16384
#: the budget is this fraction of the memory the longest sample needs on one rank with full recompute
BUDGET_FRACTION = 0.95
#: timed runs per policy (interleaved); each policy's fastest run is compared
REPEATS = 2


# ----------------------------------------------------------------- data


def samples_hash(step_ids: list[list[int]]) -> str:
    h = hashlib.sha256()
    for ids in step_ids:
        h.update(json.dumps(sorted(ids)).encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------- the torchrun worker


def lm_micro_batch(dc, model, batch) -> None:
    """Forward and backward of one text `Batch` in its micro-batch context (the loss summed
    over the shard's targets; `dc.sync_gradients()` normalizes by the step's count)."""
    from dcparallel.models.llama import per_token_loss

    with dc.micro_batch(batch) as ctx:
        ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
        ctx.backward(ctx.token_loss(ptl, batch.loss_mask))


def _model(num_layers: int):
    import torch

    from dcparallel.models.llama import Llama, LlamaConfig

    torch.manual_seed(SEED)
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden=128, num_layers=num_layers, num_heads=4, ffn_hidden=352))


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from dcparallel.cost.profiled import ProfiledCost
    from dcparallel.data.collate import text_batch
    from dcparallel.plan.types import MicroBatch
    from dcparallel.profile.cache import load_or_profile
    from dcparallel.profile.inputs import reference_spec, text_inputs
    from dcparallel.profile.profiler import Profiler, ProfilerConfig, representative_sizes
    from dcparallel.runtime.engine import Engine as DataCentricParallel
    from dcparallel.runtime.launch import init_distributed
    from dcparallel.spec import ClusterSpec, Layout, Recompute

    torch.set_num_threads(1)
    init_distributed(device="cpu", timeout=timedelta(seconds=120))  # the demo compares CPU ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    lengths = [int(x) for x in (out / "lengths.txt").read_text().split()]
    dataset = SyntheticText(lengths)

    # -- profile at world 2 (cached in the output folder across demo runs)
    model = _model(args.layers)
    spec, _ = reference_spec(model, model.layers)
    big = ClusterSpec(world_size=world, gpus_per_node=world, memory_bytes=2**40, name="cpu")
    dc = DataCentricParallel(model, layers=model.layers, num_heads=spec.num_heads, cluster=big)
    t0 = time.perf_counter()
    # micro-batch sizes doubled while throughput does not fall (min_gain 0: a noisy small
    # layout must not end a chain early; packed bins are priced from the largest measured)
    config = ProfilerConfig(repeats=3, min_time_s=0.4, min_gain=0.0, max_mbs=16, max_tokens=4096,
                            progress=rank == 0)
    profiler = Profiler(model, model.layers, text_inputs(model, torch.device("cpu")), spec=spec, config=config,
                        engine=dc)
    profile, stats = load_or_profile(out / "profile.json", profiler, representative_sizes(spec, lengths))
    profile_s = time.perf_counter() - t0

    # -- the memory budget: the longest sample does not fit one rank even with full
    # recomputation, so it needs SP = 2 (and, at this budget, recomputation there too)
    longest = max(lengths)
    probe = ProfiledCost(profile, big)
    L = spec.num_layers
    one_rank_full = probe.terms((longest,), 1).memory(Recompute(L, L))
    two_ranks_full = probe.terms((longest,), 2).memory(Recompute(L, L))
    budget = int(BUDGET_FRACTION * one_rank_full)
    if budget < two_ranks_full:
        raise ValueError(f"the longest sample ({longest} tokens) needs {two_ranks_full / 2**20:.1f} MiB per rank "
                         f"even at SP=2 with full recomputation, more than the {budget / 2**20:.1f} MiB budget; "
                         f"use shorter samples")
    cluster = ClusterSpec(world_size=world, gpus_per_node=world, memory_bytes=budget, name="cpu-budget")
    cost = ProfiledCost(profile, cluster)

    # -- warm-up before anything is timed: every SP degree and recompute path once (the first
    # all-to-all of a group and first-time allocations cost ~1 s here, which would otherwise
    # be charged to whichever policy runs first); then the per-step overhead outside
    # fwd/bwd/sync, the optimizer step, measured
    opt = dc.optimizer(lr=args.lr)
    i_long = max(range(len(lengths)), key=lengths.__getitem__)
    for sp in (1, world):
        ranks = (rank,) if sp == 1 else tuple(range(world))
        for rc in (Recompute(0, 0), Recompute(L, L)):
            lm_micro_batch(dc, model, text_batch(MicroBatch((i_long,), Layout(sp, 1, rc)), ranks, rank,
                                                 {i_long: dataset[i_long]}))
            dc.sync_gradients()
    warm = text_batch(MicroBatch((0,), Layout(1, 1)), (rank,), rank, {0: dataset[0]})
    ts = []
    for _ in range(5):
        lm_micro_batch(dc, model, warm)
        dc.sync_gradients()
        a = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - a)
    optimizer_s = sorted(ts)[2]

    # -- the runs: policies interleaved, `repeats` rounds; each policy keeps its fastest run
    # (noise on a shared machine only adds time) and every run's wall time is reported
    results: dict[str, dict] = {}
    for rep in range(args.repeats):
        for policy in args.policies:
            run = _train_once(args, policy, dataset, lengths, cost, cluster, spec, dc.groups)
            prev = results.get(policy)
            if prev is not None and (run["samples_hash"], run["losses"]) != (prev["samples_hash"], prev["losses"]):
                raise RuntimeError(f"{policy}: repeat {rep} trained different samples or got different losses "
                                   f"than repeat 0; runs must be deterministic")
            walls = (prev["walls"] if prev else []) + [run["wall_s"]]
            if prev is None or run["wall_s"] < prev["wall_s"]:
                results[policy] = run
            results[policy]["walls"] = walls
            if rank == 0:
                log.warning("%-7s run %d/%d: wall %.1f s, %d steps, loss %.3f -> %.3f", policy, rep + 1,
                            args.repeats, run["wall_s"], run["steps"], run["loss_first"], run["loss_last"])
    if rank == 0:
        (out / "real.json").write_text(json.dumps({
            "world": world, "memory_budget_bytes": budget, "budget_rule":
            f"{BUDGET_FRACTION} x the memory the longest sample ({longest} tokens) needs on one rank with full "
            f"recomputation: it must run at SP=2", "profile_s": profile_s, "profile_reused": stats is None,
            "optimizer_step_s": optimizer_s, "tokens_per_step": args.tokens_per_step, "layers": args.layers,
            "repeats": args.repeats, "policies": results}))
    dist.destroy_process_group()
    return 0


def _train_once(args, policy, dataset, lengths, cost, cluster, spec, groups) -> dict:
    """One timed training run of `policy` from a fresh model, on the process groups created
    (and warmed up) once: wall time of the loop, losses, the samples of each step, and
    per-rank busy spans of each step."""
    from dcparallel.data.loader import DataCentricLoader
    from dcparallel.runtime import comm
    from dcparallel.runtime.engine import Engine as DataCentricParallel

    model = _model(args.layers)
    dc = DataCentricParallel(model, layers=model.layers, num_heads=spec.num_heads, groups=groups, seed=SEED)
    opt = dc.optimizer(lr=args.lr)
    loader = DataCentricLoader(dataset, lengths, cost=cost, cluster=cluster, policy=policy,
                               tokens_per_step=args.tokens_per_step, seed=SEED, num_workers=0, lookahead=2)
    losses, step_ids, steps_log = [], [], []
    comm.barrier()
    start = time.perf_counter()
    for step in loader:
        t_step = time.perf_counter()
        segs = []
        for batch in step:
            a = time.perf_counter()
            lm_micro_batch(dc, model, batch)
            rc = batch.layout.recompute
            segs.append((a - t_step, time.perf_counter() - t_step, batch.layout.sp, rc.attn + rc.mlp > 0))
        compute_end = time.perf_counter() - t_step
        losses.append(dc.sync_gradients())
        opt.step()
        steps_log.append({"segs": segs, "compute_end": compute_end, "end": time.perf_counter() - t_step,
                          "sp": sorted({g.sp for g in step.plan.groups if g.micro_batches})})
        step_ids.append(list(step.plan.sample_ids))
    wall = time.perf_counter() - start
    logs = comm.all_gather_object(steps_log)
    walls = comm.all_gather_object(wall)
    tokens = sum(lengths[i] for ids in step_ids for i in ids)
    return {
        "wall_s": max(walls), "tokens_per_s": tokens / max(walls), "steps": len(step_ids),
        "samples": sum(len(x) for x in step_ids), "samples_hash": samples_hash(step_ids),
        "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
        "rank_steps": logs,
    }


# ----------------------------------------------------------------- the orchestrator


def _timelines(real: dict, names: tuple[str, ...]) -> dict[str, dict[int, list]]:
    """Per-rank busy / idle / sync spans of each real run, on one time axis per run (steps
    laid end to end; a step lasts as long as its slowest rank)."""
    out = {}
    for name in names:
        per_rank = real["policies"][name]["rank_steps"]
        tl: dict[int, list] = {r: [] for r in range(len(per_rank))}
        t0 = 0.0
        for k in range(len(per_rank[0])):
            steps = [per_rank[r][k] for r in range(len(per_rank))]
            slowest = max(s["compute_end"] for s in steps)
            dur = max(s["end"] for s in steps)
            for r, s in enumerate(steps):
                for a, b, sp, rec in s["segs"]:
                    tl[r].append((t0 + a, t0 + b, f"busy sp={sp}" + (" recompute" if rec else "")))
                busy_end = s["segs"][-1][1] if s["segs"] else 0.0
                if slowest > busy_end:
                    tl[r].append((t0 + busy_end, t0 + slowest, "idle"))
                tl[r].append((t0 + slowest, t0 + dur, "sync"))
            t0 += dur
        out[name] = tl
    return out


def predict(out: Path, lengths: list[int], real: dict) -> dict[str, dict]:
    """Simulated wall time of each policy's run from the same profile and budget: the plans'
    compute + gradient sync, plus the optimizer step measured before training."""
    from dcparallel.cost.profiled import Profile, ProfiledCost
    from dcparallel.plan.context import PlanContext
    from dcparallel.plan.steps import form_steps
    from dcparallel.sim.run import plan_epoch
    from dcparallel.spec import ClusterSpec, Workload

    profile = Profile.load(out / "profile.json")
    cluster = ClusterSpec(world_size=real["world"], gpus_per_node=real["world"],
                          memory_bytes=real["memory_budget_bytes"], name="cpu-budget")
    ctx = PlanContext(Workload(profile.model, tuple(lengths)), ProfiledCost(profile, cluster), cluster)
    steps = form_steps(ctx.tokens, seed=SEED, tokens_per_step=real["tokens_per_step"])
    pred = {}
    for name in real["policies"]:
        run = plan_epoch(ctx, steps, name)
        pred[name] = {"wall_s": run.sim.total_time + len(steps) * real["optimizer_step_s"],
                      "idle_fraction": run.sim.idle_fraction,
                      "settings": {k: v for k, v in run.settings.items() if k != "tried_s"}}
    return pred


def _check_fits(lengths: list[int], num_layers: int) -> None:
    """A sample far beyond this machine's memory is refused here, with the planner's message,
    before torchrun starts (inside, the profiler would die on a raw allocator error)."""
    from dcparallel.profile.inputs import reference_spec
    from dcparallel.train import check_fits

    model = _model(num_layers)
    spec, _ = reference_spec(model, model.layers)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // WORLD
    check_fits(spec, lengths, WORLD, WORLD, memory)


def run(args: argparse.Namespace) -> dict:
    from dcparallel.cli import paper_scale
    from dcparallel.report.plots import plot_paper_scale_timeline, plot_speedups, plot_timelines
    from dcparallel.scenarios import read_lengths

    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "-m", "dcparallel.demo", "--worker", "--out", str(out), "--layers", str(args.layers),
           "--tokens-per-step", str(args.tokens_per_step), "--repeats", str(args.repeats), "--policies", *POLICIES]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(f"[demo] training {len(lengths)} samples on {WORLD} gloo ranks: {' '.join(POLICIES)}", file=sys.stderr)
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the training launch failed with exit code {proc.returncode}: {' '.join(cmd)}")
    launch_s = time.perf_counter() - t0
    real = json.loads((out / "real.json").read_text())
    pred = predict(out, lengths, real)
    errors = {n: abs(pred[n]["wall_s"] - real["policies"][n]["wall_s"]) / real["policies"][n]["wall_s"]
              for n in real["policies"]}
    print("[demo] simulating the paper-scale scenarios ...", file=sys.stderr)
    simulated = [] if args.skip_paper_scale else paper_scale()
    p = real["policies"]
    artifacts = [plot_timelines(_timelines(real, ("bucket", "dcp")), out / "timeline.png",
                                title=f"real run on {WORLD} CPU ranks: bucket vs dcp (busy / idle per rank)")]
    if simulated:
        artifacts.append(plot_speedups(simulated, out / "speedups.png"))
        artifacts.append(plot_paper_scale_timeline(out / "timeline_paper_scale.png"))
    summary = {
        "real": {"world": real["world"], "memory_budget_bytes": real["memory_budget_bytes"],
                 "budget_rule": real["budget_rule"], "lengths": source, "samples_total": len(lengths),
                 "repeats": real["repeats"],
                 "policies": {n: {**{k: v[k] for k in ("wall_s", "tokens_per_s", "steps", "samples", "samples_hash",
                                                       "loss_first", "loss_last")}, "wall_s_runs": v["walls"]}
                              for n, v in p.items()},
                 "speedup": p["bucket"]["wall_s"] / p["dcp"]["wall_s"],
                 "speedup_vs_packed": p["packed"]["wall_s"] / p["dcp"]["wall_s"]},
        "predicted": {n: {"wall_s": v["wall_s"], "idle_fraction": v["idle_fraction"]} for n, v in pred.items()},
        "prediction_error": max(errors.values()),
        "simulated": simulated,
        "profile_s": real["profile_s"], "profile_reused": real["profile_reused"], "launch_s": launch_s,
        "artifacts": [],
    }
    report = write_report(out, summary, pred, errors, real)
    summary["artifacts"] = [str(a) for a in [report, *artifacts]]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def write_report(out: Path, s: dict, pred: dict, errors: dict, real: dict) -> Path:
    r = s["real"]
    same = len({v["samples_hash"] for v in r["policies"].values()}) == 1
    profiling = "reused a cached profile" if s["profile_reused"] else f"took {s['profile_s']:.0f} s"
    lines = [
        f"# dcparallel demo — {time.strftime('%Y-%m-%d %H:%M')}", "",
        f"Real training of a {real['layers']}-layer Llama-style LM (hidden 128, vocab {VOCAB}) on {r['world']} gloo "
        f"ranks (one CPU thread each), {r['samples_total']} samples ({r['lengths']}), "
        f"{real['tokens_per_step']:,} tokens per step. Memory budget per rank: "
        f"{r['memory_budget_bytes'] / 2**20:.1f} MiB ({r['budget_rule']}). Profiling {profiling}; "
        f"training time below excludes start-up and profiling.", "",
        f"Each policy ran {r['repeats']} times, interleaved with the others; its fastest run counts (all runs: "
        "\"runs\" column). Every SP degree and recompute path was warmed up before the first timed run.", "",
        "| policy | wall s | runs s | tokens/s | steps | samples | loss first → last | predicted wall s | error | "
        "speedup vs bucket |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = r["policies"]["bucket"]["wall_s"]
    for n, v in r["policies"].items():
        runs = ", ".join(f"{w:.1f}" for w in v["wall_s_runs"])
        lines.append(f"| {n} | {v['wall_s']:.1f} | {runs} | {v['tokens_per_s']:,.0f} | {v['steps']} | {v['samples']} | "
                     f"{v['loss_first']:.3f} → {v['loss_last']:.3f} | {pred[n]['wall_s']:.1f} | "
                     f"{100 * errors[n]:.0f}% | {base / v['wall_s']:.2f} |")
    lines += ["", f"dcp vs bucket: **{r['speedup']:.2f}×**; dcp vs packed: **{r['speedup_vs_packed']:.2f}×**; "
              f"prediction error (max over policies): {100 * s['prediction_error']:.0f}%. "
              f"All runs trained the same samples in the same steps: {'yes' if same else 'NO'} "
              f"(hash of each step's sample ids).", "",
              "Planner settings (from the simulator's replanning): " +
              "; ".join(f"{n}: {pred[n]['settings']}" for n in pred), "",
              "![timeline](timeline.png)", "",
              "Reading the timeline: colour is the SP degree of the micro-batch a rank runs, hatching marks "
              "recomputation, red is a rank waiting. With the longest samples needing SP = 2 on 2 ranks, the tuned "
              "`bucket` (like `packed`) runs everything as one SP = 2 group over both ranks: it never waits, it pays "
              "all-to-alls and recomputation on every micro-batch instead. `dcp` runs a step's long samples at "
              "SP = 2 first, then the short ones at SP = 1 on each rank (two phases), balanced so that neither rank "
              "waits long. Idle time under static data parallelism shows at scale: the simulated 32-GPU timeline "
              "below.", ""]
    if s["simulated"]:
        lines += ["## Paper scale (simulated, 32 × H200)", "", "![speedups](speedups.png)", "",
                  "![paper-scale timeline](timeline_paper_scale.png)", "",
                  "| scenario | distribution | " + " | ".join(s["simulated"][0]["speedup_vs_bucket"]) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in s["simulated"][0]["speedup_vs_bucket"]) + " |"]
        for x in s["simulated"]:
            lines.append(f"| {x['scenario']} | {x['distribution']} | " +
                         " | ".join(f"{v:.2f}" for v in x["speedup_vs_bucket"].values()) + " |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def print_table(s: dict) -> None:
    r = s["real"]
    print(f"real run, {r['world']} CPU ranks, {r['samples_total']} samples, budget "
          f"{r['memory_budget_bytes'] / 2**20:.1f} MiB/rank")
    print(f"{'policy':8s} {'wall s':>8s} {'tokens/s':>9s} {'predicted s':>12s} {'loss':>15s}")
    for n, v in r["policies"].items():
        print(f"{n:8s} {v['wall_s']:8.1f} {v['tokens_per_s']:9,.0f} {s['predicted'][n]['wall_s']:12.1f} "
              f"{v['loss_first']:6.3f} -> {v['loss_last']:.3f}")
    print(f"dcp speedup vs bucket {r['speedup']:.2f}x, vs packed {r['speedup_vs_packed']:.2f}x; "
          f"prediction error {100 * s['prediction_error']:.0f}%")
    print("artifacts: " + ", ".join(s["artifacts"]))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo_out", help="output folder (report, plots, profile cache)")
    p.add_argument("--lengths", default=None, help="token counts, one per line, instead of the built-in data")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP)
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help="timed runs per policy, interleaved; each policy's fastest counts (default %(default)s)")
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
        return worker(args)
    return cmd_demo(args)


if __name__ == "__main__":
    sys.exit(main())
