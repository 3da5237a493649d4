"""`dcparallel simulate` and `plan`, and `paper_scale` (every built-in scenario at 32 GPUs).

The workload arguments, an epoch planned and simulated per policy, step plans printed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from dcparallel.apps.simulate_words import USER_POLICIES, layout_words, plan_stats, ring_words, verdict
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.auto_shard import auto_shard_size
from dcparallel.cost.lora import with_lora
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.provenance import calibration_source, describe
from dcparallel.cost.schema import Profile
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import ALL, make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import (
    ALL_DISTRIBUTIONS,
    DEFAULT_SEED,
    DISTRIBUTIONS,
    MIXES,
    MODEL_PRESETS,
    SCENARIOS,
    long_token_share,
    model_preset,
    read_lengths,
    sample_sizes,
)
from dcparallel.sim.replay import replay_step, simulate, step_seconds
from dcparallel.sim.run import PLAN_TIME_NOTE, run_policies, summary
from dcparallel.spec import ClusterSpec, ModelSpec, Workload, format_bytes, h200_cluster


def shard_size_argument(text: str) -> int | str:
    """``--shard-size``: a positive integer or ``auto``."""
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard size: give a power of two (1, 2, 4, 8, ...) or auto")
    return v


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments that say what is planned: model, data, cluster, step budget, cost model."""
    _add_model_arguments(p)
    _add_data_arguments(p)
    _add_cluster_arguments(p)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default=None,
        help="model and step budget (text: Llama-7B-like; video: Open-Sora-1.2-like DiT)",
    )
    mod = p.add_mutually_exclusive_group()
    mod.add_argument(
        "--model",
        choices=sorted(MODEL_PRESETS),
        default=None,
        help="a published architecture (with its scenario's data unless --lengths)",
    )
    mod.add_argument(
        "--model-config",
        type=Path,
        default=None,
        help="a transformers or diffusers config.json: the model is built on the meta device (no "
        "weights) and planned with exact parameter counts",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="plan a LoRA fine-tune of --model / --model-config: the base frozen, adapters of this rank "
        "on every linear of the blocks trained (`cost.lora.with_lora`)",
    )


def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--distribution",
        choices=ALL_DISTRIBUTIONS,
        help=f"built-in length distribution ({', '.join(DISTRIBUTIONS)}) or realistic mix "
        f"({', '.join(f'{k}: {v.kind}' for k, v in MIXES.items())}); default balanced",
    )
    src.add_argument(
        "--lengths",
        type=Path,
        help="one sample a line: `tokens` or `frames height width`; or a .npy array; or (a "
        'vision-language --model) a .jsonl of {"text": tokens, "vision": [image sizes]}',
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="data and step-order seed")
    p.add_argument(
        "--tokens-per-step", type=int, default=None, help="tokens per optimizer step (default: the scenario's)"
    )


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shard-size",
        type=shard_size_argument,
        default=1,
        help="ranks per parameter-shard block (1, 2, 4, ...; default 1: unsharded), or auto: the smallest "
        "with which the model states and the data fit",
    )
    p.add_argument(
        "--ring",
        action="store_true",
        help="SP groups past the head count: each micro-batch at its fastest Ulysses x ring split",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="usable memory per GPU in GiB (default: an H200's 128; e.g. 72 for an 80 GB H100)",
    )
    p.add_argument("--world", type=int, default=None, help="GPUs (default: the --profile's world size, else 32)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node (default: the --profile's, else 8 or the world if smaller)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="plan from a measured profile (ProfiledCost) instead of the analytic H200 model",
    )


def _setup(args) -> tuple[str, Workload, ClusterSpec, object, int]:
    """(name, workload, cluster, cost model, tokens per step) from the common arguments."""
    spec = _model_of(args)
    _default_world(args)
    sizes = None if args.lengths is None else _read_lengths(args.lengths, spec)
    if spec is not None and args.profile is not None:
        raise SystemExit("error: --profile plans its own model; leave out --model / --model-config")
    profile = Profile.load(args.profile) if spec is None and args.profile is not None else None
    if spec is not None:
        scenario, model = _scenario_of_model(args, spec), spec
        cluster = h200_cluster(args.world, args.gpus_per_node, memory_bytes=_memory(args))
    elif profile is not None:
        scenario, model, cluster = None, profile.model, _profile_cluster(args, profile)
    else:
        scenario = _scenario_of_data(args, sizes)
        model = scenario.model
        cluster = h200_cluster(args.world, args.gpus_per_node, memory_bytes=_memory(args))
    name, sizes = _samples(args, sizes, model, scenario)
    tps = args.tokens_per_step or (scenario.tokens_per_step if scenario else 4 * 2**20)
    if profile is not None:
        make_cost = lambda m, c: ProfiledCost(profile, c)  # noqa: E731
    else:
        make_cost = AnalyticCost
    # ring first: it lets SP groups past the head count, which the shard sizes auto tries may need
    cluster = dataclasses.replace(cluster, ring=getattr(args, "ring", False))
    shard = getattr(args, "shard_size", 1)
    if shard == "auto":
        shard = auto_shard_size(model, cluster, sizes, make_cost=make_cost)
    cluster = dataclasses.replace(cluster, shard_size=shard)
    return name, Workload(model, tuple(sizes)), cluster, make_cost(model, cluster), tps


def _scenario_of_model(args, spec: ModelSpec):
    """--model / --model-config: the scenario (step budget, data) of its kind unless --scenario names one."""
    if args.scenario is not None and SCENARIOS[args.scenario].model.kind != spec.kind:
        raise SystemExit(
            f"error: --scenario {args.scenario} is for {SCENARIOS[args.scenario].model.kind} "
            f"models, {spec.name} is a {spec.kind} model"
        )
    args.scenario = args.scenario or spec.kind
    return SCENARIOS[args.scenario]


def _profile_cluster(args, profile: Profile) -> ClusterSpec:
    """--profile: the cluster of its launch, with its memory."""
    # the H200 links price shard blocks planned from an unsharded profile (`ProfiledCost`)
    cluster = h200_cluster(
        args.world,
        args.gpus_per_node,
        memory_bytes=int(profile.fingerprint.get("memory_bytes", h200_cluster().memory_bytes)),
    )
    if profile.world_size != args.world:
        raise SystemExit(
            f"error: the profile was measured at world size {profile.world_size}; pass --world {profile.world_size}"
        )
    return cluster


def _scenario_of_data(args, sizes: list | None):
    """No model given: --scenario, else the kind of the --lengths or of the --distribution's mix."""
    if args.scenario is None:
        if sizes is not None:
            args.scenario = "video" if isinstance(sizes[0], tuple) else "text"
        elif args.distribution in MIXES:
            args.scenario = MIXES[args.distribution].kind
        else:
            raise SystemExit("error: give --scenario (and --distribution or --lengths)")
    if args.distribution in MIXES and MIXES[args.distribution].kind != args.scenario:
        raise SystemExit(
            f"error: --distribution {args.distribution} is a {MIXES[args.distribution].kind} mix; "
            f"use it with --scenario {MIXES[args.distribution].kind}"
        )
    return SCENARIOS[args.scenario]


def _samples(args, sizes: list | None, model: ModelSpec, scenario) -> tuple[str, list]:
    """(name, sample sizes): the --lengths read, else drawn from --distribution (default balanced)."""
    if sizes is not None:
        kind = "video" if isinstance(sizes[0], tuple) else "text"
        if kind != model.kind:
            raise SystemExit(f"error: {args.lengths} holds {kind} samples but the model is a {model.kind} model")
        return args.lengths.name, sizes
    if scenario is None:
        raise SystemExit("error: with --profile give --lengths FILE")
    dist = args.distribution or "balanced"
    return dist, sample_sizes(args.scenario, dist, seed=args.seed)


def _default_world(args) -> None:
    """--world and --gpus-per-node not given: the profile's launch, else 32 GPUs, 8 a node."""
    if args.world is None or args.gpus_per_node is None:
        launch = Profile.load(args.profile) if args.profile is not None else None
        args.world = args.world or (launch.world_size if launch else 32)
        args.gpus_per_node = args.gpus_per_node or (launch.gpus_per_node if launch else min(8, args.world))


def _memory(args) -> int | None:
    gib = getattr(args, "memory_gib", None)
    if gib is not None and not gib > 0:
        raise SystemExit(f"error: --memory-gib {gib}: give the usable GiB per GPU (> 0)")
    return None if gib is None else int(gib * 2**30)


def _read_lengths(path: Path, spec: ModelSpec | None) -> list:
    """--lengths: a .jsonl of vision-language samples (with a vision-language --model) or
    `read_lengths`' formats."""
    if path.suffix != ".jsonl":
        return read_lengths(path)
    if spec is None or spec.vision is None:
        vlms = sorted(k for k, m in MODEL_PRESETS.items() if m.vision is not None)
        raise SystemExit(
            f"error: {path} is a .jsonl lengths file of vision-language samples; give a vision-language "
            f"--model ({', '.join(vlms)})"
        )
    from dcparallel.data.vision_sizes import read_vision_lengths

    try:
        return read_vision_lengths(path, spec.vision)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None


def _model_of(args) -> ModelSpec | None:
    """The model of --model or --model-config (None: the scenario's or the profile's), with
    LoRA adapters of --lora-rank."""
    rank = getattr(args, "lora_rank", None)
    spec = None
    if getattr(args, "model", None):
        spec = model_preset(args.model)
    elif getattr(args, "model_config", None) is not None:
        from dcparallel.apps.model_config import spec_from_config

        spec = spec_from_config(args.model_config)
    if rank is not None:
        if spec is None:
            raise SystemExit("error: --lora-rank needs --model or --model-config")
        try:
            spec = with_lora(spec, rank)
        except ValueError as e:
            raise SystemExit(f"error: --lora-rank: {e}") from None
    return spec


def simulate_json(args, policies: Sequence[str], progress: bool = True) -> dict:
    name, workload, cluster, cost, tps = _setup(args)
    t0 = time.perf_counter()
    ctx, steps, runs, bound = run_policies(
        workload,
        cost,
        cluster,
        policies,
        tokens_per_step=tps,
        seed=args.seed,
        progress=progress,
        max_steps=getattr(args, "max_steps", None),
    )
    per = summary(workload, runs, bound)
    for k, r in runs.items():  # what the plans did, for the line under the table (`simulate_words`)
        per[k].update(plan_stats(r.plans, workload.tokens))
    m = workload.model
    out = {
        "scenario": args.scenario or m.name,
        "distribution": name,
        "world": cluster.world_size,
        "gpus_per_node": cluster.gpus_per_node,
        "seed": args.seed,
        "tokens_per_step": tps,
        "model": m.name,
        "num_params": m.num_params,
        "shard_size": cluster.shard_size,
        "shard_size_auto": getattr(args, "shard_size", 1) == "auto",
        "memory_bytes": cluster.memory_bytes,
        "model_state_bytes": round(cost.model_state_bytes()),
        "peak_memory_bytes": max((v["peak_memory_bytes"] for v in per.values()), default=0),
        "samples_total": len(workload),
        "steps": len(steps),
        "long_token_share": round(long_token_share(workload.model, list(workload.sizes)), 4),
        "lower_bound_s": round(bound, 4),
        "plan_time_includes": PLAN_TIME_NOTE,
        "policies": per,
        "calibration": calibration_source(cost, getattr(args, "profile", None)),
    }
    if isinstance(cost, ProfiledCost):
        out.update(prediction_spread(cost, cluster, ctx, runs))
    if "bucket" in runs:
        out["bucket_sp"] = runs["bucket"].settings["sp"]
        out["bucket_recompute"] = runs["bucket"].settings["recompute"]
        base = runs["bucket"].sim.total_time
        out["speedup_vs_bucket"] = {k: round(base / r.sim.total_time, 4) for k, r in runs.items()}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["warning"] = beaten_warning(per)
    return out


def beaten_warning(per: dict) -> str | None:
    """A warning naming every policy whose simulated epoch is faster than the chosen one's
    (`dcp` where it ran, else the first policy given), by how much; None where none is."""
    if len(per) < 2:
        return None
    chosen = "dcp" if "dcp" in per else next(iter(per))
    t = per[chosen]["epoch_time_s"]
    faster = {k: v["epoch_time_s"] for k, v in per.items() if k != chosen and v["epoch_time_s"] < t}
    if not faster:
        return None
    return (
        f"warning: {chosen} is not the fastest policy here: "
        + ", ".join(f"{k} is {t / f:.3f}x faster" for k, f in sorted(faster.items(), key=lambda kv: kv[1]))
        + f"; train with --policy {min(faster, key=faster.get)} or report this mix"
    )


def prediction_spread(cost: ProfiledCost, cluster: ClusterSpec, ctx: PlanContext, runs: dict) -> dict:
    """How far each policy's predicted epoch time can be off through the profile's noise: its
    plans replayed with every measured layout at the low and at the high end of its interval
    (`ProfileEntry.time_range`), and the profile's noise warning (None when it is fine)."""
    profile = cost.profile
    out: dict = {"profile_noise_warning": profile.noise_warning()}
    if profile.spreads() is None:
        out["profile_spread"] = "unknown: the profile holds no spread per entry (profile again to measure it)"
        return out
    ends = {
        at: PlanContext(ctx.workload, ProfiledCost(profile, cluster, time_at=at), cluster) for at in ("low", "high")
    }
    for name, r in runs.items():
        lo, hi = (simulate(r.plans, ends[at]).total_time for at in ("low", "high"))
        out.setdefault("predicted_epoch_s_range", {})[name] = [round(lo, 4), round(hi, 4)]
    return out


def paper_scale(
    world: int = 32, gpus_per_node: int = 8, desc: str = "paper-scale simulation", workers: int = 1
) -> list[dict]:
    """`simulate --json` of every built-in scenario x distribution at paper scale, all policies,
    in scenario order; with ``workers`` > 1, the cells are shared by that many fresh processes
    (spawned, not forked: the caller may hold torch's threads), each cell whole in one."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    from tqdm import tqdm

    cells = [(sc, d, world, gpus_per_node) for sc in ("video", "text") for d in DISTRIBUTIONS]
    if workers <= 1:
        return [paper_cell(*c) for c in tqdm(cells, desc=desc, file=sys.stderr)]
    with ProcessPoolExecutor(min(workers, len(cells)), mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(paper_cell, *c) for c in cells]
        for _ in tqdm(as_completed(futures), total=len(cells), desc=desc, file=sys.stderr):
            pass
        return [f.result() for f in futures]


def paper_cell(scenario: str, distribution: str, world: int, gpus_per_node: int) -> dict:
    """One paper-scale cell: `simulate --json` of a built-in scenario and distribution, all policies."""
    ns = argparse.Namespace(
        scenario=scenario,
        distribution=distribution,
        lengths=None,
        world=world,
        gpus_per_node=gpus_per_node,
        seed=DEFAULT_SEED,
        tokens_per_step=None,
        profile=None,
        model=None,
        model_config=None,
        shard_size=1,
    )
    return simulate_json(ns, ALL, progress=False)


def _table(out: dict) -> str:
    rows = [
        f"{out['scenario']} / {out['distribution']}: {out['samples_total']} samples, {out['steps']} steps "
        f"of {out['tokens_per_step']:,} tokens, world {out['world']} GPUs ({out['gpus_per_node']} per node), "
        f"{100 * out['long_token_share']:.0f}% of tokens in samples > 64k"
    ]
    hdr = (
        f"{'policy':15s} {'vs bucket':>9s} {'tokens/s':>12s} {'step time s':>11s} {'ranks idle':>10s} "
        f"{'of lower bound':>14s} {'planning ms/step':>16s} {'peak memory':>11s}  layout"
    )
    rows.append(hdr)
    speedup = out.get("speedup_vs_bucket")
    for k, v in out["policies"].items():
        sp = f"{speedup[k]:8.2f}x" if speedup else f"{'-':>9s}"
        rows.append(
            f"{k:15s} {sp} {v['tokens_per_s']:12,.0f} {v['step_time_s_median']:11.3f} "
            f"{100 * v['idle_fraction']:9.1f}% {100 * v['lower_bound_efficiency']:13.1f}% "
            f"{v['plan_ms_per_step']:16.2f} {100 * v['peak_memory_fraction']:10.0f}%  "
            f"{layout_words(k, v['settings'])}"
        )
    if ring_words(out["policies"]):
        rows.append(ring_words(out["policies"]))
    line = verdict(out["policies"]) if all("sp_mean_per_token" in v for v in out["policies"].values()) else None
    if line:
        rows.append(line)
    if not speedup:
        rows.append("speedup is relative to bucket, which did not run: add --policy bucket to see it")
    if "model" in out:
        rows.append(
            f"model {out['model']} ({out['num_params'] / 1e9:.2f}B parameters), shard size {out['shard_size']}"
            f"{' (auto)' if out['shard_size_auto'] else ''}: model states "
            f"{format_bytes(out['model_state_bytes'])}, planned peak {format_bytes(out['peak_memory_bytes'])} "
            f"of {format_bytes(out['memory_bytes'])} per rank"
        )
    if "predicted_epoch_s_range" in out:
        rows.append(
            "epoch s if every profiled layout were at the low / high end of its measured interval: "
            + ", ".join(f"{k} {lo:.3f}-{hi:.3f}" for k, (lo, hi) in out["predicted_epoch_s_range"].items())
        )
    for key in ("profile_spread", "profile_noise_warning"):
        if out.get(key):
            rows.append(f"{key.replace('_', ' ')}: {out[key]}")
    if "calibration" in out:
        rows.append(describe(out["calibration"]))
    rows.append(
        PLAN_TIME_NOTE
        + "; first step and setup ms: "
        + ", ".join(f"{k} {v['plan_first_step_ms']:.1f} / {v['setup_ms']:.0f}" for k, v in out["policies"].items())
    )
    return "\n".join(rows)


def cmd_simulate(args) -> int:
    policies = ALL if args.all else args.policy or list(USER_POLICIES)
    out = simulate_json(args, policies, progress=not args.quiet)
    if args.json:
        print(json.dumps(out))
    else:
        print(_table(out))
    if out["warning"]:
        print(out["warning"], file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    name, workload, cluster, cost, tps = _setup(args)
    ctx = PlanContext(workload, cost, cluster)
    steps = form_steps(workload.tokens, seed=args.seed, tokens_per_step=tps)
    planner = make_planner(args.policy, ctx, steps, score=step_seconds(ctx))
    for s in steps[: args.steps]:
        plan = planner.plan(s)
        res = replay_step(plan, ctx)
        d = plan.to_json()
        d["policy"] = args.policy
        d["predicted_step_s"] = round(res.step_time, 6)
        for g, busy, segs in zip(d["groups"], res.group_busy, res.group_segments, strict=True):
            g["predicted_busy_s"] = round(busy, 6)
            for mb, seg in zip(g["micro_batches"], segs, strict=True):
                mb["predicted_s"] = round(seg.end - seg.start, 6)
        if args.json:
            print(json.dumps(d))
        else:
            print(
                f"step {plan.index}: {len(plan.sample_ids)} samples, {plan.num_tokens:,} tokens, "
                f"predicted {res.step_time:.3f} s"
            )
            phased = plan.num_phases > 1
            for g, busy in zip(plan.groups, res.group_busy):
                lay = [
                    f"[{len(m.sample_ids)} sample{'s' * (len(m.sample_ids) > 1)} at {m.layout.sp_words()}, "
                    f"recompute {m.layout.recompute.describe(ctx.model.num_layers)}]"
                    for m in g.micro_batches
                ]
                phase = f"phase {g.phase} " if phased else ""
                print(
                    f"  {phase}ranks {g.ranks[0]}-{g.ranks[-1]}: {len(g.micro_batches)} micro-batches, "
                    f"busy {busy:.3f} s  {', '.join(lay[:6])}{' ...' if len(lay) > 6 else ''}"
                )
    return 0
