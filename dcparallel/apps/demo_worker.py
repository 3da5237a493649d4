"""The demo's torchrun worker: profile, warm up, then per round calibrate and train every policy, timed.

Profiles the tiny LM at world 2, warms up, then for each repeat trains the same samples in the
same steps once per policy untimed and once timed (the training loop only). The untimed runs
measure how much slower training runs the profile's layouts than the profile timed them
(`training_factor`, pooled over every policy and round).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m dcparallel.apps.demo --worker ...

(`dcparallel demo` launches it; `dcparallel.apps.demo` holds the orchestrator.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import time
from datetime import timedelta
from pathlib import Path

from dcparallel.apps.presets import llama
from dcparallel.data.synthetic import SyntheticText

log = logging.getLogger("dcparallel.demo")

#: the reference LM of `presets.LLAMAS` the demo trains (at its --layers depth)
MODEL = "tiny-llama"
SEED = 0
#: the budget is this fraction of the memory the longest sample needs on one rank with full recompute
BUDGET_FRACTION = 0.95


def samples_hash(step_ids: list[list[int]]) -> str:
    h = hashlib.sha256()
    for ids in step_ids:
        h.update(json.dumps(sorted(ids)).encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------- the torchrun worker


def lm_micro_batch(dc, model, batch) -> None:
    """Forward and backward of one text `Batch` in its micro-batch context (the loss summed
    over the shard's targets; `dc.sync_gradients()` normalizes by the step's count)."""
    from dcparallel.loss import per_token_loss

    with dc.micro_batch(batch) as ctx:
        ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
        ctx.backward(ctx.token_loss(ptl, batch.loss_mask))


def demo_model(num_layers: int):
    """The demo's LM at `num_layers` depth, freshly initialised from the demo's seed."""
    return llama(MODEL, seed=SEED, num_layers=num_layers)


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from dcparallel.cost.profiled import ProfiledCost
    from dcparallel.data.collate import text_batch
    from dcparallel.plan.types import MicroBatch
    from dcparallel.profile.cache import load_or_profile
    from dcparallel.profile.inputs import reference_spec, text_inputs
    from dcparallel.profile.profiler import Profiler, ProfilerConfig, representative_sizes
    from dcparallel.runtime.engine import Engine
    from dcparallel.runtime.launch import end_distributed, init_distributed
    from dcparallel.spec import ClusterSpec, Layout, Recompute

    torch.set_num_threads(1)
    # the demo compares CPU ranks; profiling waits up to minutes in a collective for the slower
    # rank's SP-1 layouts on a loaded machine (ranks measure different buckets at SP 1)
    init_distributed(device="cpu", timeout=timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    lengths = [int(x) for x in (out / "lengths.txt").read_text().split()]
    dataset = SyntheticText(lengths)

    # -- profile at world 2 (cached in the output folder across demo runs)
    model = demo_model(args.layers)
    spec, _ = reference_spec(model, model.layers)
    big = ClusterSpec(world_size=world, gpus_per_node=world, memory_bytes=2**40, name="cpu")
    dc = Engine(model, layers=model.layers, num_heads=spec.num_heads, cluster=big)
    t0 = time.perf_counter()
    # micro-batch sizes doubled up to 4096 tokens (min_gain 0: a noisy small layout must not
    # end a chain early), so packed's bins of up to ~50 short samples are priced between
    # measured sizes, not extrapolated past 16 samples (those bins ran at 0.6-0.9x that price);
    # rounds stop at +-5%. The reference run is timed in every round as a record of the
    # machine's speed, not to rescale: on a quiet machine it is slowed more by the SP 2 work
    # before it than by load, and rescaling would price SP 2 layouts too cheap (`profile.drift`)
    config = ProfilerConfig(
        repeats=3,
        min_time_s=0.4,
        min_gain=0.0,
        max_tokens=4096,
        rel_tol=0.05,
        max_repeats=12,
        reference=True,
        rescale=False,
        progress=rank == 0,
    )
    profiler = Profiler(
        model, model.layers, text_inputs(model, torch.device("cpu")), spec=spec, config=config, engine=dc
    )
    profile, stats = load_or_profile(out / "profile.json", profiler, representative_sizes(spec, lengths))
    profile_s = time.perf_counter() - t0
    # the profile's reference run, timed between the steps of every timed run: the machine's
    # speed during the run against the speed the profile prices at (`profile.drift`)
    clock = profiler.reference_clock(min(profile.buckets, key=lambda b: b.tokens).size) if profile.reference_s else None

    # -- the memory budget: the longest sample does not fit one rank even with full
    # recomputation, so it needs SP = 2 (and, at this budget, recomputation there too)
    longest = max(lengths)
    probe = ProfiledCost(profile, big)
    L = spec.num_layers
    one_rank_full = probe.terms((longest,), 1).memory(Recompute(L, L))
    two_ranks_full = probe.terms((longest,), 2).memory(Recompute(L, L))
    budget = int(BUDGET_FRACTION * one_rank_full)
    if budget < two_ranks_full:
        raise ValueError(
            f"the longest sample ({longest} tokens) needs {two_ranks_full / 2**20:.1f} MiB per rank "
            f"even at SP=2 with full recomputation, more than the {budget / 2**20:.1f} MiB budget; "
            f"use shorter samples"
        )
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
            lm_micro_batch(
                dc, model, text_batch(MicroBatch((i_long,), Layout(sp, 1, rc)), ranks, rank, {i_long: dataset[i_long]})
            )
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
    # -- training does not run at the profile's prices: the machine's speed moves between
    # profiling and training (and from minute to minute), and training runs different shapes
    # one after another between optimizer steps where the profile timed a loop of one
    # micro-batch. Before every timed round, one untimed run of every policy, built like the
    # timed runs (a fresh model, every step), measures by how much: one factor for all
    # policies, the machine's, not each policy's, pooled over the rounds so that it measures
    # the minutes the timed runs ran in. The runs: policies interleaved, `repeats` rounds;
    # each policy keeps its median run (`counted_run`) and every run's wall time is reported
    calibration: list[dict[str, dict]] = []
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        calibration.append(
            {
                policy: _train_once(args, policy, dataset, lengths, cost, cluster, spec, dc.groups, clock)
                for policy in args.policies
            }
        )
        for policy in args.policies:
            run = _train_once(args, policy, dataset, lengths, cost, cluster, spec, dc.groups, clock)
            first = runs.setdefault(policy, [run])[0]
            if (run["samples_hash"], run["losses"]) != (first["samples_hash"], first["losses"]):
                raise RuntimeError(
                    f"{policy}: repeat {rep} trained different samples or got different losses "
                    f"than repeat 0; runs must be deterministic"
                )
            if rep:
                runs[policy].append(run)
            if rank == 0:
                log.warning(
                    "%-7s run %d/%d: wall %.1f s, %d steps, loss %.3f -> %.3f",
                    policy,
                    rep + 1,
                    args.repeats,
                    run["wall_s"],
                    run["steps"],
                    run["loss_first"],
                    run["loss_last"],
                )
    factor = training_factor([run for rnd in calibration for run in rnd.values()])
    if rank == 0:
        log.warning(
            "training ran the profile's layouts %.3fx as long as profiled (one untimed run of every "
            "policy before each timed round); predictions are scaled by it",
            factor,
        )
    results = {policy: {**counted_run(rs), "walls": [r["wall_s"] for r in rs]} for policy, rs in runs.items()}
    if rank == 0:
        (out / "real.json").write_text(
            json.dumps(
                {
                    "world": world,
                    "memory_budget_bytes": budget,
                    "budget_rule": f"{BUDGET_FRACTION} x the memory the longest sample ({longest} tokens) needs "
                    f"on one rank with full recomputation: it must run at SP=2",
                    "profile_s": profile_s,
                    "profile_reused": stats is None,
                    "optimizer_step_s": optimizer_s,
                    "training_factor": factor,
                    # per calibration round and policy, each step's factor; per policy, its timed runs' own
                    "calibration": [{p: step_factors(r) for p, r in rnd.items()} for rnd in calibration],
                    "timed_factors": {p: [training_factor([r]) for r in rs] for p, rs in runs.items()},
                    "tokens_per_step": args.tokens_per_step,
                    "layers": args.layers,
                    "repeats": args.repeats,
                    "policies": results,
                }
            )
        )
    del dc, opt, profiler, model  # before the process group ends (`end_distributed`)
    end_distributed()
    return 0


def counted_run(runs: list[dict]) -> dict:
    """The run of a policy that counts: its median by wall time (of an even number, the faster
    of the middle two). The prediction prices the machine at its typical speed (each profiled
    layout's median round), and on a VM whose speed swings both ways within minutes (two runs
    of one plan took 26.8 and 20.4 s on a 2-core VM) the fastest run measures a fast spell."""
    return sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]


def training_factor(runs: list[dict], skip: int = 0) -> float:
    """How many times the profile's price the micro-batches of these runs took: their
    measured busy time over their priced time, summed over every rank and step but each
    run's first `skip` (the demo counts them all: a fresh model's slower first step is part
    of every timed run too)."""
    return _busy_over_priced(st for run in runs for rank_steps in run["rank_steps"] for st in rank_steps[skip:])


def step_factors(run: dict) -> list[float]:
    """Per step of a run, its micro-batches' measured busy time over their priced time (both ranks)."""
    return [_busy_over_priced(steps) for steps in zip(*run["rank_steps"])]


def _busy_over_priced(steps) -> float:
    """Summed over these step logs: micro-batch busy time over priced time."""
    measured = priced = 0.0
    for st in steps:
        measured += sum(b - a for a, b, *_ in st["segs"])
        priced += sum(st["priced"])
    if priced <= 0:
        raise ValueError("no micro-batch was trained to calibrate against the profile")
    return measured / priced


def shape_price(cost, shape) -> float:
    """A logged micro-batch shape's price (``shapes`` in real.json: sample lengths, SP degree,
    recomputed attention and MLP layers) by ``cost``."""
    from dcparallel.spec import Recompute

    lens, sp, attn, mlp = shape
    return cost.terms(tuple(lens), sp).time(Recompute(attn, mlp))


def _train_once(args, policy, dataset, lengths, cost, cluster, spec, groups, clock=None) -> dict:
    """One timed training run of `policy` from a fresh model, on the process groups created
    (and warmed up) once: wall time of the loop, losses, the samples of each step, and
    per-rank busy spans of each step with each micro-batch's price (``priced``: its time by
    the profile) and shape (``shapes``: sample lengths, SP degree, recomputed layers).
    ``clock``: the profile's `ReferenceClock`, ticked twice after every step outside the
    timed wall (``reference_s``: the median over both ranks)."""
    from dcparallel.data import DataCentricLoader
    from dcparallel.runtime import comm
    from dcparallel.runtime.engine import Engine

    model = demo_model(args.layers)
    dc = Engine(model, layers=model.layers, num_heads=spec.num_heads, groups=groups, seed=SEED)
    opt = dc.optimizer(lr=args.lr)
    loader = DataCentricLoader(
        dataset,
        lengths,
        cost=cost,
        cluster=cluster,
        policy=policy,
        tokens_per_step=args.tokens_per_step,
        seed=SEED,
        num_workers=0,
        lookahead=2,
    )
    loader.start_planning()  # before the timed wall
    losses, step_ids, steps_log = [], [], []
    mark = clock.mark() if clock else 0
    paused = 0.0
    comm.barrier()
    start = time.perf_counter()
    for step in loader:
        t_step = time.perf_counter()
        segs, mbs = [], []
        for batch in step:
            a = time.perf_counter()
            lm_micro_batch(dc, model, batch)
            rc = batch.layout.recompute
            segs.append((a - t_step, time.perf_counter() - t_step, batch.layout.sp, rc.attn + rc.mlp > 0))
            mbs.append((batch.sample_ids, batch.layout))
        compute_end = time.perf_counter() - t_step
        losses.append(dc.sync_gradients())
        opt.step()
        end = time.perf_counter() - t_step
        a = time.perf_counter()  # pricing and logging are outside the timed wall
        # each micro-batch's sample lengths, SP degree and recompute, so that its price can be
        # recomputed from another profile without planning the run again
        shapes = [([lengths[i] for i in ids], lay.sp, lay.recompute.attn, lay.recompute.mlp) for ids, lay in mbs]
        priced = [shape_price(cost, sh) for sh in shapes]
        paused += time.perf_counter() - a
        steps_log.append(
            {
                "segs": segs,
                "priced": priced,
                "shapes": shapes,
                "compute_end": compute_end,
                "end": end,
                "sp": step.plan.busy_sizes(),
            }
        )
        step_ids.append(list(step.plan.sample_ids))
        if clock:
            a = time.perf_counter()
            clock.tick()
            clock.tick()
            paused += time.perf_counter() - a
    wall = time.perf_counter() - start - paused
    logs = comm.all_gather_object(steps_log)
    refs = [t for ts in comm.all_gather_object(clock.times[mark:] if clock else []) for t in ts]
    walls = comm.all_gather_object(wall)
    tokens = sum(lengths[i] for ids in step_ids for i in ids)
    return {
        "wall_s": max(walls),
        "tokens_per_s": tokens / max(walls),
        "steps": len(step_ids),
        "samples": sum(len(x) for x in step_ids),
        "samples_hash": samples_hash(step_ids),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses,
        "rank_steps": logs,
        "reference_s": statistics.median(refs) if refs else None,
    }
