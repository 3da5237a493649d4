"""Device check of the profiler: profile the reference models on one GPU with --validate and
write a dated report (extrapolated vs full-depth time and memory, per validated layout).

For a session that is lent a GPU (one call, a few minutes of device time):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tools/profile_device_check.py --out-dir "$OUT"

writes ``profile-device_<gpu>_<date>.md`` and ``.json`` (and the profiles) into --out-dir;
copy the report into benchmarks/. Models: Llama-7B dimensions at 8 layers (the depth of the
H200 claim in DESIGN) and the ~1.1B video DiT at 6 spatial+temporal pairs, bf16, world 1
(SP=1). On GPU, memory is the allocator's peak (torch.cuda.max_memory_allocated), so
memory_error there checks the extrapolation against the real allocator.

``--dry-run`` runs the same code on this CPU with the tiny models and tiny buckets (it checks
the script, not the numbers). Every model runs in a try block: one failure is reported and
the rest still run; the report is rewritten after each model, so a run cut short by the time
limit still leaves what it measured. ``--budget-s`` skips models once that much time is spent.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dcparallel.apps.profile import run_profile  # noqa: E402

GPU_RUNS = [  # the shorter model first: a run cut short keeps it
    {
        "model": "dit-1b",
        "num_layers": 12,
        "buckets": "51x240x426,51x480x853,102x720x1280",
        "repeats": 3,
        "max_mbs": 8,
        "max_tokens": 131072,
    },
    {
        "model": "llama-7b",
        "num_layers": 8,
        "buckets": "2048,8192,32768",
        "repeats": 3,
        "max_mbs": 8,
        "max_tokens": 65536,
    },
]
DRY_RUNS = [
    {
        "model": "tiny-llama",
        "num_layers": 4,
        "buckets": "128,256",
        "repeats": 1,
        "max_mbs": 2,
        "max_tokens": 512,
        "min_time": 0.0,
        "warmup": 1,
        "max_repeats": 1,
    },
    {
        "model": "tiny-dit",
        "num_layers": 4,
        "buckets": "17x64x64",
        "repeats": 1,
        "max_mbs": 2,
        "max_tokens": 512,
        "min_time": 0.0,
        "warmup": 1,
        "max_repeats": 1,
    },
]


def namespace(run: dict, device: str, out_dir: Path) -> argparse.Namespace:
    return argparse.Namespace(
        model=run["model"],
        buckets=run["buckets"],
        depth=2,
        num_layers=run["num_layers"],
        validate=True,
        repeats=run["repeats"],
        min_time=run.get("min_time", 0.5),
        warmup=run.get("warmup", 2),
        max_mbs=run["max_mbs"],
        max_tokens=run["max_tokens"],
        max_repeats=run.get("max_repeats", 25),
        modes="none,attn,mlp,full",
        memory_limit=None,
        device=device,
        dtype=None,
        threads=1,
        out=out_dir / f"profile-{run['model']}-{run['num_layers']}l.json",
        reuse=False,
        json=True,
        quiet=True,
    )


def report(results: list[dict], meta: dict) -> str:
    lines = [
        f"# Profiler device check: {meta['device']}, {meta['date']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, host {meta['host']}. World 1 (SP=1), "
        f"bf16 on GPU. Each layout is measured on stacks of 1 and 2 layers (median of the repeats "
        f"after warm-up, CUDA events) and extrapolated to full depth, t_L = t2 + (L-2)(t2-t1), the same "
        f"for memory (allocator peak minus what was allocated before the forward). Validation runs "
        f"the smallest and largest bucket with recompute none and full at full depth in the same "
        f"interleaved rounds.",
        "",
    ]
    if meta.get("dry_run"):
        lines += [
            "**DRY RUN on CPU** (tiny models, tiny buckets): checks the script only; the numbers "
            "are not a device measurement.",
            "",
        ]
    lines += [
        "| model | blocks | layers (units) | layouts | infeasible | unfit buckets | seconds | time_error "
        "| memory_error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['num_layers']} | | failed: {r['error'][:80]} | | | | | |")
            continue
        s = r["summary"]
        lines.append(
            f"| {r['model']} | {r['num_layers']} | {s['num_layers']} | {s['layouts_measured']} | "
            f"{s['layouts_infeasible']} | "
            f"{', '.join(s['unfit_buckets']) or '-'} | {s['seconds']} | {s['time_error']} | "
            f"{s['memory_error']} |"
        )
    lines += [
        "",
        "Validated layouts (predicted = extrapolated from 1 and 2 layers):",
        "",
        "| model | bucket | sp | mbs | recompute | time predicted s | time full s | err | "
        "memory predicted GiB | memory full GiB | err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for v in r.get("summary", {}).get("validation", []):
            if "error" in v:
                lines.append(
                    f"| {r['model']} | {v['bucket']} | {v['sp']} | {v['mbs']} | {v['recompute']} | "
                    f"full depth out of memory: {v['error'][:60]} | | | | | |"
                )
                continue
            gib = 2**30
            lines.append(
                f"| {r['model']} | {v['bucket']} | {v['sp']} | {v['mbs']} | {v['recompute']} | "
                f"{v['predicted_time_s']:.4f} | {v['full_depth_time_s']:.4f} | {v['time_error']:.3f} | "
                f"{v['predicted_memory_bytes'] / gib:.2f} | {v['full_depth_memory_bytes'] / gib:.2f} | "
                f"{v['memory_error']:.4f} |"
            )
    for r in results:
        if "traceback" in r:
            lines += ["", f"Failure of {r['model']}:", "", "```", r["traceback"][-3000:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", ROOT / "benchmarks")))
    ap.add_argument("--dry-run", action="store_true", help="tiny models on CPU: checks the script only")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip models once this much time is spent")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch; run with --dry-run on a CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    torch.set_num_threads(1)
    name = (
        "cpu-dryrun"
        if args.dry_run
        else re.sub(r"[^a-z0-9]+", "", torch.cuda.get_device_name().lower().replace("nvidia", ""))
    )
    date = dt.date.today().isoformat()
    meta = {
        "device": "CPU dry run" if args.dry_run else torch.cuda.get_device_name(),
        "date": date,
        "command": " ".join([Path(__file__).name, *(sys.argv[1:] if argv is None else argv)]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.machine(),
        "dry_run": args.dry_run,
    }
    base = args.out_dir / f"profile-device_{name}_{date}"
    results: list[dict] = []
    t0 = time.perf_counter()
    for run in DRY_RUNS if args.dry_run else GPU_RUNS:
        if time.perf_counter() - t0 > args.budget_s:
            results.append(
                {
                    "model": run["model"],
                    "num_layers": run["num_layers"],
                    "error": f"skipped: {args.budget_s:.0f} s budget spent",
                }
            )
            continue
        print(f"profiling {run['model']} ({run['num_layers']} layers) ...", file=sys.stderr, flush=True)
        try:
            summary = run_profile(namespace(run, device, args.out_dir))
            results.append({"model": run["model"], "num_layers": run["num_layers"], "summary": summary})
            print(json.dumps(summary), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the other models still run
            results.append(
                {
                    "model": run["model"],
                    "num_layers": run["num_layers"],
                    "error": repr(exc),
                    "traceback": traceback.format_exc(),
                }
            )
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        finally:
            gc.collect()  # the last model and its engine
            if device == "cuda":
                torch.cuda.empty_cache()
        base.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        base.with_suffix(".md").write_text(report(results, meta))
    print(f"wrote {base}.md and .json ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0 if all("summary" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
