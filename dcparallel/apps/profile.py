"""`dcparallel profile`: profile a preset reference model here (CPU or GPU), and print or save it.

Optionally validated at full depth. Launch with torchrun to profile SP layouts on the launch's world (gloo on CPU,
NCCL on GPU); a plain launch is one rank and covers SP=1 only.

With ``--json`` the last line on stdout is one JSON object: layouts_measured,
layouts_infeasible, seconds, time_error, memory_error (max relative error of extrapolated vs
full depth; null without --validate), profile_path, and details.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from datetime import timedelta
from pathlib import Path

import torch

GIB = 1024**3


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1.5e9"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*(B|KiB|MiB|GiB|TiB)?\s*", text)
    units = {None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": GIB, "TiB": 1024**4}
    try:
        value = float(m.group(1)) * units[m.group(2)] if m else -1.0
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"bad memory size {text!r}; write e.g. 512MiB, 80GiB or a byte count")
    return int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dcparallel.apps.presets import PRESETS

    p.add_argument(
        "--model", required=True, choices=sorted(PRESETS), help="; ".join(f"{k}: {v.help}" for k, v in PRESETS.items())
    )
    p.add_argument(
        "--buckets",
        default=None,
        help="comma-separated bucket sizes: tokens (1024) or frames x height x width (51x240x426); "
        "default: the model's",
    )
    p.add_argument("--depth", type=int, default=2, help="measure stacks of depth-1 and depth layers (default 2)")
    p.add_argument("--num-layers", type=int, default=None, help="override the model's depth")
    p.add_argument(
        "--validate",
        action="store_true",
        help="also run a few layouts at full depth and report the extrapolation error",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per depth (median; default 5)")
    p.add_argument(
        "--max-repeats",
        type=int,
        default=25,
        help="more timed runs while the median is not known to +-3%% (noise), up to this (default 25)",
    )
    p.add_argument(
        "--min-time",
        type=float,
        default=1.0,
        help="more timed runs for short layouts, up to about this many seconds a layout (default 1)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per depth first (default 1)")
    p.add_argument("--max-mbs", type=int, default=64, help="largest micro-batch size tried (default 64)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="stop doubling the micro-batch past this many tokens (default: 2048 on cpu, none on cuda)",
    )
    p.add_argument("--modes", default="none,attn,mlp,full", help="recompute modes (default all four)")
    p.add_argument(
        "--memory-limit",
        default=None,
        help="memory per rank for model states + activations, e.g. 512MiB (CPU: a fake allocator "
        "limit; GPU: a budget below the card's memory)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on cuda, float32 on cpu"
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (default 1: pinned)")
    p.add_argument("--out", type=Path, default=None, help="profile file (default out/profile-MODEL-wWORLD.json)")
    p.add_argument("--reuse", action="store_true", help="reuse --out if its fingerprint matches")
    p.add_argument("--json", action="store_true", help="one JSON object on one line, last on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _init_distributed(device: str) -> None:
    from dcparallel.runtime.launch import init_distributed

    init_distributed(device, timeout=timedelta(seconds=300))


def run_profile(args: argparse.Namespace) -> dict:
    """Profiles per the arguments on every rank; returns the JSON summary (same on every rank)."""
    from dcparallel.apps.presets import get_preset, parse_buckets
    from dcparallel.profile.cache import load_or_profile, profile_and_save
    from dcparallel.profile.profiler import Profiler, ProfilerConfig
    from dcparallel.runtime import comm

    preset = get_preset(args.model)  # the arguments first: a typo is reported before any set-up
    sizes = parse_buckets(args.buckets) if args.buckets else list(preset.buckets)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; use --device cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    torch.set_num_threads(args.threads)
    _init_distributed(device)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    built = preset.build(dev, dtype, args.num_layers)
    cfg = ProfilerConfig(
        depth=args.depth,
        warmup=args.warmup,
        repeats=args.repeats,
        max_mbs=args.max_mbs,
        min_time_s=args.min_time,
        max_repeats=max(args.max_repeats, args.repeats),
        max_tokens=args.max_tokens or (2048 if device == "cpu" else None),
        memory_limit=parse_bytes(args.memory_limit) if args.memory_limit else None,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        validate=args.validate,
        progress=not args.quiet,
    )
    profiler = Profiler(
        built.model, built.layers, built.make_inputs, spec=built.spec, config=cfg, layers_per_unit=built.layers_per_unit
    )
    out = args.out or Path("out") / f"profile-{args.model}-w{comm.world_size()}.json"
    if args.reuse:
        profile, stats = load_or_profile(out, profiler, sizes)
    else:
        profile, stats = profile_and_save(out, profiler, sizes)
    summary = {
        "model": args.model,
        "device": profile.fingerprint.get("device"),
        "dtype": str(dtype).replace("torch.", ""),
        "world_size": profile.world_size,
        "num_layers": profile.model.num_layers,
        "buckets": [b.key for b in profile.buckets],
        "layouts_measured": len(profile.entries),
        "layouts_infeasible": sum(not e.feasible for e in profile.entries),
        "unfit_buckets": profile.unfit_buckets,
        "reused": stats is None,
        "seconds": round(stats.seconds, 2) if stats else 0.0,
        "time_error": None if stats is None or stats.time_error is None else round(stats.time_error, 4),
        "memory_error": None if stats is None or stats.memory_error is None else round(stats.memory_error, 4),
        "validation": []
        if stats is None
        else [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()} for row in stats.validation],
        "slopes_clamped": 0 if stats is None else stats.slopes_clamped,
        "cuda_memory": None if stats is None else stats.cuda_memory,
        "model_state_bytes": profile.model_state_bytes,
        "profile_path": str(out),
    }
    return summary


def cmd_profile(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    summary = run_profile(args)
    from dcparallel.runtime import comm

    if comm.world_rank() == 0:
        if args.json:
            print(json.dumps(summary), flush=True)
        else:
            print(
                f"profiled {summary['model']} on {summary['device']} ({summary['dtype']}, world "
                f"{summary['world_size']}): {summary['layouts_measured']} layouts, "
                f"{summary['layouts_infeasible']} infeasible, {summary['seconds']} s -> {summary['profile_path']}"
            )
            if summary["unfit_buckets"]:
                print(f"buckets that fit no layout: {summary['unfit_buckets']}")
            for row in summary["validation"]:
                if "error" in row:
                    print(
                        f"  validate {row['bucket']} sp={row['sp']} mbs={row['mbs']} {row['recompute']:4s}: "
                        f"full depth did not run ({row['error']})"
                    )
                    continue
                print(
                    f"  validate {row['bucket']} sp={row['sp']} mbs={row['mbs']} {row['recompute']:4s}: "
                    f"time {row['predicted_time_s']:.4f} s predicted vs {row['full_depth_time_s']:.4f} s "
                    f"({100 * row['time_error']:.1f}%), memory {100 * row['memory_error']:.2f}%"
                )
            if summary["time_error"] is not None:
                print(f"max error: time {summary['time_error']:.3f}, memory {summary['memory_error']:.3f}")
    from dcparallel.runtime.launch import end_distributed

    end_distributed()  # `run_profile`'s profiler and model are gone by now
    return 0
