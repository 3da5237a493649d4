"""The demo's torchrun worker: profile, plan, warm up, then train every policy, timed, round by round.

Profiles the tiny LM at world 2 (within a wall-time budget, `profile.budget`), plans every
policy's epoch with the simulator and prints the plans, warms up, then for each repeat trains
the same samples in the same steps once per policy, timed (the training loop only). After the
first round, one untimed run of every policy measures how much slower training runs the
profile's layouts than the profile timed them (`training_factor`, pooled over the policies).
After every round rank 0 prints the comparison so far: after the first, one run of each policy
(its spread unknown, its predictions at the profile's prices, said so); after each later one,
each policy's median run, the spread of its runs and the predictions scaled by the factor.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m dcparallel.apps.demo --worker ...

(`dcparallel demo` launches it; `dcparallel.apps.demo` holds the orchestrator.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
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


@dataclass
class RunSetting:
    """What every training run of one launch shares: the data, the cost model and cluster of
    the memory budget, the process groups (created and warmed up once) and the profile's
    reference clock (None: the profile has no reference run)."""

    args: argparse.Namespace
    dataset: SyntheticText
    lengths: list[int]
    cost: object
    cluster: object
    spec: object
    groups: object
    clock: object = None


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

    from dcparallel.apps.demo_predict import simulate_policies
    from dcparallel.apps.demo_report import print_plans
    from dcparallel.cost.profiled import ProfiledCost
    from dcparallel.profile.inputs import reference_spec
    from dcparallel.runtime.engine import Engine
    from dcparallel.runtime.launch import end_distributed, init_distributed
    from dcparallel.spec import ClusterSpec

    torch.set_num_threads(1)
    # the demo compares CPU ranks; profiling waits up to minutes in a collective for the slower
    # rank's SP-1 layouts on a loaded machine (ranks measure different buckets at SP 1)
    init_distributed(device="cpu", timeout=timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    lengths = [int(x) for x in (out / "lengths.txt").read_text().split()]
    model = demo_model(args.layers)
    spec, _ = reference_spec(model, model.layers)
    big = ClusterSpec(world_size=world, gpus_per_node=world, memory_bytes=2**40, name="cpu")
    dc = Engine(model, layers=model.layers, num_heads=spec.num_heads, cluster=big)
    record: dict = {"world": world}
    mark = _now()
    profiler, profile, stats, profile_s = _profile(args, model, spec, dc, lengths, rank)
    mark = _lap(record, "profile", mark)
    # the profile's reference run, timed between the steps of every timed run: the machine's
    # speed during the run against the speed the profile prices at (`profile.drift`)
    clock = profiler.reference_clock(min(profile.buckets, key=lambda b: b.tokens).size) if profile.reference_s else None
    budget, rule = memory_budget(ProfiledCost(profile, big), spec.num_layers, lengths)
    cluster = ClusterSpec(world_size=world, gpus_per_node=world, memory_bytes=budget, name="cpu-budget")
    cost = ProfiledCost(profile, cluster)
    dataset = SyntheticText(lengths)
    setting = RunSetting(args, dataset, lengths, cost, cluster, spec, dc.groups, clock)
    record.update(
        memory_budget_bytes=budget,
        budget_rule=rule,
        profile_s=profile_s,
        profile_reused=stats is None,
        profile_budget_s=args.profile_budget,
        profile_chains_coarse=stats.chains_coarse if stats else None,
        profile_chains_skipped=stats.chains_skipped if stats else None,
        profile_reference_s=profile.reference_s,
        tokens_per_step=args.tokens_per_step,
        layers=args.layers,
        repeats=args.repeats,
    )
    if rank == 0:  # the first result: what was profiled, and what each policy plans
        record["plans"] = simulate_policies(cost, cluster, lengths, args.policies, args.tokens_per_step, SEED)
        print_plans(record, sys.stderr)
    mark = _lap(record, "plan", mark)
    record["optimizer_step_s"] = _warm_up(dc, model, dataset, lengths, spec.num_layers, args.lr)
    _lap(record, "warm_up", mark)
    calibration, runs = _rounds(setting, record if rank == 0 else None)
    if rank == 0:
        (out / "real.json").write_text(json.dumps(_real(record, calibration, runs)))
    del dc, profiler, model  # before the process group ends (`end_distributed`)
    end_distributed()
    return 0


def _now() -> tuple[float, float]:
    """Wall seconds and this process's processor seconds, now."""
    return time.perf_counter(), time.process_time()


def _lap(record: dict | None, name: str, since: tuple[float, float]) -> tuple[float, float]:
    """`_now`; with ``record``, the phase ``name`` since ``since`` recorded in its ``phase_s``
    (wall) and ``phase_cpu_s`` (processor seconds of this rank: what the phase costs whatever
    else runs on the cores), appended to a list for the repeated ``rounds``."""
    now = _now()
    if record is not None:
        for key, a, b in (("phase_s", since[0], now[0]), ("phase_cpu_s", since[1], now[1])):
            phases = record.setdefault(key, {"rounds": []})
            if name == "rounds":
                phases["rounds"].append(b - a)
            else:
                phases[name] = b - a
    return now


def _profile(args, model, spec, dc, lengths: list[int], rank: int):
    """The profile at world 2, cached in the output folder across demo runs, within
    ``args.profile_budget`` seconds: (profiler, profile, stats or None if reused, seconds)."""
    import torch

    from dcparallel.profile.cache import load_or_profile
    from dcparallel.profile.inputs import text_inputs
    from dcparallel.profile.profiler import Profiler, ProfilerConfig, representative_sizes

    # micro-batch sizes doubled up to 4096 tokens (min_gain 0: a noisy small layout must not
    # end a chain early), so packed's bins of up to ~50 short samples are priced between
    # measured sizes, not extrapolated past 16 samples (those bins ran at 0.6-0.9x that price);
    # rounds stop at +-5%. The reference run is timed in every round as a record of the
    # machine's speed, not to rescale: on a quiet machine it is slowed more by the SP 2 work
    # before it than by load, and rescaling would price SP 2 layouts too cheap (`profile.drift`).
    # The budget measures the largest buckets' chains coarsely when the rest would not fit
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
        budget_s=args.profile_budget,
    )
    profiler = Profiler(
        model, model.layers, text_inputs(model, torch.device("cpu")), spec=spec, config=config, engine=dc
    )
    t0 = time.perf_counter()
    profile, stats = load_or_profile(Path(args.out) / "profile.json", profiler, representative_sizes(spec, lengths))
    return profiler, profile, stats, time.perf_counter() - t0


def memory_budget(probe, num_layers: int, lengths: list[int]) -> tuple[int, str]:
    """The per-rank memory budget, priced by ``probe`` (the profile without a budget), and its
    rule: the longest sample does not fit one rank even with full recomputation, so it needs
    SP = 2 (and, at this budget, recomputation there too)."""
    from dcparallel.spec import Recompute

    longest = max(lengths)
    full = Recompute(num_layers, num_layers)
    one_rank_full = probe.terms((longest,), 1).memory(full)
    two_ranks_full = probe.terms((longest,), 2).memory(full)
    budget = int(BUDGET_FRACTION * one_rank_full)
    if budget < two_ranks_full:
        raise ValueError(
            f"the longest sample ({longest} tokens) needs {two_ranks_full / 2**20:.1f} MiB per rank "
            f"even at SP=2 with full recomputation, more than the {budget / 2**20:.1f} MiB budget; "
            f"use shorter samples"
        )
    rule = (
        f"{BUDGET_FRACTION} x the memory the longest sample ({longest} tokens) needs "
        f"on one rank with full recomputation: it must run at SP=2"
    )
    return budget, rule


def _warm_up(dc, model, dataset, lengths: list[int], num_layers: int, lr: float) -> float:
    """Every SP degree and recompute path run once before anything is timed (the first
    all-to-all of a group and first-time allocations cost ~1 s here, which would otherwise be
    charged to whichever policy runs first); returns the optimizer step's time (the median of
    five), the per-step overhead outside fwd/bwd/sync."""
    import torch.distributed as dist

    from dcparallel.data.collate import text_batch
    from dcparallel.plan.types import MicroBatch
    from dcparallel.spec import Layout, Recompute

    rank, world = dist.get_rank(), dist.get_world_size()
    opt = dc.optimizer(lr=lr)
    i_long = max(range(len(lengths)), key=lengths.__getitem__)
    for sp in (1, world):
        ranks = (rank,) if sp == 1 else tuple(range(world))
        for rc in (Recompute(0, 0), Recompute(num_layers, num_layers)):
            mb = MicroBatch((i_long,), Layout(sp, 1, rc))
            lm_micro_batch(dc, model, text_batch(mb, ranks, rank, {i_long: dataset[i_long]}))
            dc.sync_gradients()
    warm = text_batch(MicroBatch((0,), Layout(1, 1)), (rank,), rank, {0: dataset[0]})
    ts = []
    for _ in range(5):
        lm_micro_batch(dc, model, warm)
        dc.sync_gradients()
        a = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - a)
    return sorted(ts)[2]


def _rounds(setting: RunSetting, record: dict | None) -> tuple[list[dict[str, dict]], dict[str, list[dict]]]:
    """``args.repeats`` rounds of one timed run of every policy (interleaved), and after the
    first round the calibration: one untimed run of every policy; returns the calibration (a
    list of its one set of runs; empty before it ran) and each policy's timed runs.

    Training does not run at the profile's prices: the machine's speed moves between profiling
    and training, and training runs different shapes one after another between optimizer steps
    where the profile timed a loop of one micro-batch. The untimed runs, built like the timed
    runs (a fresh model, every step), measure by how much: one factor for all policies, the
    machine's, not each policy's, measured on runs that are not the ones it predicts. They run
    once, between the first and the second timed round, so that the first comparison comes
    after one run of each policy (with the predictions at the profile's prices, said so); the
    reference run ticked between the steps of every timed run tracks the machine's speed run by
    run (`profile.drift`). With ``record`` (rank 0), the comparison so far is printed after
    every round (`demo_report.print_round`) and each phase's seconds are recorded (`_lap`)."""
    calibration: list[dict[str, dict]] = []
    runs: dict[str, list[dict]] = {}
    for rep in range(setting.args.repeats):
        mark = _now()
        _timed_round(setting, rep, runs, record is not None)
        _lap(record, "rounds", mark)
        if record is not None:
            _print_so_far(record, calibration, runs, rep + 1)
        if rep == 0:
            mark = _now()
            where = "calibration after round 1, untimed"
            calibration.append({p: _logged_run(setting, p, where, record is not None) for p in setting.args.policies})
            _lap(record, "calibration", mark)
    return calibration, runs


def _timed_round(setting: RunSetting, rep: int, runs: dict[str, list[dict]], verbose: bool) -> None:
    """One timed run of every policy, appended to ``runs``; a run that trains other samples or
    gets other losses than the policy's first is refused (runs must be deterministic)."""
    where = f"round {rep + 1} of {setting.args.repeats}, timed"
    for policy in setting.args.policies:
        run = _logged_run(setting, policy, where, verbose)
        first = runs.setdefault(policy, [])[:1]
        if first and (run["samples_hash"], run["losses"]) != (first[0]["samples_hash"], first[0]["losses"]):
            raise RuntimeError(
                f"{policy}: repeat {rep} trained different samples or got different losses "
                f"than repeat 0; runs must be deterministic"
            )
        runs[policy].append(run)


def _print_so_far(record: dict, calibration: list[dict[str, dict]], runs: dict[str, list[dict]], done: int) -> None:
    """The comparison after ``done`` rounds on stderr (`demo_report.print_round`); the wall
    clock of the first, for the orchestrator."""
    from dcparallel.apps.demo_predict import predict
    from dcparallel.apps.demo_report import print_round

    so_far = _real(record, calibration, runs)
    print_round(so_far, predict(so_far), done, record["repeats"], sys.stderr)
    record.setdefault("first_comparison_at", time.time())


def _logged_run(setting: RunSetting, policy: str, what: str, verbose: bool) -> dict:
    """`_train_once`, with a line on stderr when ``verbose`` (rank 0): the user sees every run end."""
    run = _train_once(setting, policy)
    if verbose:
        print(
            f"[demo] {what} run of {policy}: {run['wall_s']:.1f} s, loss {run['loss_first']:.3f} -> "
            f"{run['loss_last']:.3f}",
            file=sys.stderr,
        )
    return run


def _real(record: dict, calibration: list[dict[str, dict]], runs: dict[str, list[dict]]) -> dict:
    """real.json: ``record`` (the launch's settings, profile and plans) with the runs so far:
    the training factor pooled over the untimed runs (None before they ran), each untimed run's per-step factors,
    each timed run's own factor, and per policy its counted (median) run with every run's
    wall time (``walls``, in the order they ran)."""
    return {
        **record,
        "rounds_done": len(next(iter(runs.values()), [])),
        "training_factor": training_factor([r for rnd in calibration for r in rnd.values()]) if calibration else None,
        "calibration": [{p: step_factors(r) for p, r in rnd.items()} for rnd in calibration],
        "timed_factors": {p: [training_factor([r]) for r in rs] for p, rs in runs.items()},
        "policies": {p: {**counted_run(rs), "walls": [r["wall_s"] for r in rs]} for p, rs in runs.items()},
    }


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


def _train_once(setting: RunSetting, policy: str) -> dict:
    """One training run of `policy` from a fresh model, on the process groups created (and
    warmed up) once: wall time of the loop, losses, the samples of each step, and per-rank
    busy spans of each step with each micro-batch's price (``priced``: its time by the
    profile) and shape (``shapes``: sample lengths, SP degree, recomputed layers). The
    profile's `ReferenceClock` (``setting.clock``) is ticked twice after every step outside
    the timed wall (``reference_s``: the median over both ranks)."""
    from dcparallel.data import DataCentricLoader
    from dcparallel.runtime import comm
    from dcparallel.runtime.engine import Engine

    args, clock = setting.args, setting.clock
    model = demo_model(args.layers)
    dc = Engine(model, layers=model.layers, num_heads=setting.spec.num_heads, groups=setting.groups, seed=SEED)
    opt = dc.optimizer(lr=args.lr)
    loader = DataCentricLoader(
        setting.dataset,
        setting.lengths,
        cost=setting.cost,
        cluster=setting.cluster,
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
        log_entry, loss = _train_step(dc, model, opt, step)
        a = time.perf_counter()  # pricing, logging and the reference run are outside the timed wall
        _price(setting, log_entry)
        steps_log.append(log_entry)
        losses.append(loss)
        step_ids.append(list(step.plan.sample_ids))
        if clock:
            clock.tick()
            clock.tick()
        paused += time.perf_counter() - a
    wall = time.perf_counter() - start - paused
    return _gathered(setting, wall, losses, step_ids, steps_log, mark)


def _train_step(dc, model, opt, step) -> tuple[dict, float]:
    """One step, timed: the step's log (each micro-batch's busy span from the step's start,
    its SP degree and whether it recomputes, with its sample ids and layout under ``mbs`` to
    be priced outside the timed wall; the ends of compute and of the step) and its loss."""
    t_step = time.perf_counter()
    segs, mbs = [], []
    for batch in step:
        a = time.perf_counter()
        lm_micro_batch(dc, model, batch)
        rc = batch.layout.recompute
        segs.append((a - t_step, time.perf_counter() - t_step, batch.layout.sp, rc.attn + rc.mlp > 0))
        mbs.append((batch.sample_ids, batch.layout))
    compute_end = time.perf_counter() - t_step
    loss = dc.sync_gradients()
    opt.step()
    end = time.perf_counter() - t_step
    entry = {"segs": segs, "mbs": mbs, "compute_end": compute_end, "end": end, "sp": step.plan.busy_sizes()}
    return entry, loss


def _price(setting: RunSetting, entry: dict) -> None:
    """Replaces a step log's ``mbs`` by each micro-batch's shape (sample lengths, SP degree,
    recomputed attention and MLP layers: its price can be recomputed from another profile
    without planning the run again) and its price by the launch's profile (``priced``)."""
    lengths = setting.lengths
    shapes = [
        ([lengths[i] for i in ids], lay.sp, lay.recompute.attn, lay.recompute.mlp) for ids, lay in entry.pop("mbs")
    ]
    entry["shapes"] = shapes
    entry["priced"] = [shape_price(setting.cost, sh) for sh in shapes]


def _gathered(setting: RunSetting, wall: float, losses, step_ids, steps_log, mark: int) -> dict:
    """A run's record, gathered from every rank: the slowest rank's wall time, every rank's
    step logs, the median reference time over both ranks' ticks since ``mark``."""
    from dcparallel.runtime import comm

    clock = setting.clock
    logs = comm.all_gather_object(steps_log)
    refs = [t for ts in comm.all_gather_object(clock.times[mark:] if clock else []) for t in ts]
    walls = comm.all_gather_object(wall)
    tokens = sum(setting.lengths[i] for ids in step_ids for i in ids)
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
