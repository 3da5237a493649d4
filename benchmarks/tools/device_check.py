"""The device check: one script that proves the runtime on one GPU inside 8 minutes of device
time, writing a dated report (markdown + json) into the folder it is given (the device tool's
$OUT), rewritten after every part so that a run cut short keeps what it has.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tools/device_check.py --out "$OUT"
    PYTHONPATH=. python3 benchmarks/tools/device_check.py --out "$OUT" --parts a,c     # rerun some parts
    PYTHONPATH=. python3 benchmarks/tools/device_check.py --dry-run --out /tmp/dc      # CPU, tiny sizes

Each part runs in a process of its own (benchmarks/tools/device_check_parts.py) with a time limit
(`BUDGETS`); one that fails or runs out of time is reported and the others still run.

(a) `profile --validate` of a Llama-7B-like stack and a video DiT: extrapolated time and memory
    against full depth (benchmarks/tools/profile_device_check.py);
(b) bf16 `dcparallel train` steps at world 1 of the reference LM and a transformers Llama (GQA):
    planned vs measured step time and peak memory (allocated, reserved, mem_get_info);
(c) several ranks on one GPU: torchrun worlds 2 and 4 on cuda:0 over gloo
    (DCPARALLEL_BACKEND=gloo DCPARALLEL_SHARE_DEVICE=1) with SP 4, 2 and 1 mixed in a step, one
    SP 4 (world 4) or SP 2 (world 2) micro-batch at ring degree 2 (`runtime.ring`):
    bf16 loss and gradients against world 1 under the ZeRO-1 optimizer (each gradient bucket
    reduced into its shard's owner; gradients gathered and the clipping norm taken from the
    shards), host syncs (set_sync_debug_mode), step time with
    and without the overlapped gradient sync, and an out-of-memory error on one rank
    (set_per_process_memory_fraction) that must stop every rank;
(d) attention kernels as training takes them (`cuda_varlen_attention`: varlen_attn, FlexAttention
    for softcap and sinks) on 256 documents of 64 tokens and on 7 long ones, for GQA 32/8, a
    sliding window, softcap (Gemma 2), sinks with and without a window (gpt-oss), MLA (DeepSeek)
    and full attention (Wan): the kernel taken, output and gradient error against fp32, time
    and peak memory of forward + backward;
(e) a world-1 NCCL process group forced on: device_id, split groups, object collectives, the
    control group, an engine step;
(f) a 1.3B bf16 model at world 1 (ZeRO-1): bytes held after the optimizer step against the cost
    model's states (`state_recipe`), and the peak of sync + clip + step against its step peak;
(g) the sharded runtime (FSDP2 blocks, benchmarks/tools/sharded_device_check.py): needs 2+ GPUs, so
    with one GPU lent the report says it was skipped.

``--dry-run`` runs every part's code on CPU / gloo at tiny sizes: it checks the script, not the
numbers. There the parts share one process (`run_parts`; (f) first: it counts every tensor the
process holds), as isolation from each other's memory and budgets matters only on the GPU, and
a process of its own costs each part more than its tiny sizes do (torch's imports); the
orchestrator then never imports torch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS_SCRIPT = ROOT / "benchmarks" / "tools" / "device_check_parts.py"

#: part: (title, seconds it may take on the GPU); they add up to `DEVICE_SECONDS`
BUDGETS = {
    "a": ("(a) profile --validate", 155),
    "b": ("(b) bf16 training steps at world 1", 110),
    "c": ("(c) ranks sharing one GPU over gloo", 100),
    "d": ("(d) attention kernels training takes, against fp32", 45),
    "e": ("(e) world-1 NCCL process group", 20),
    "f": ("(f) optimizer-step memory of a 1.3B bf16 model", 30),
    "g": ("(g) sharded runtime (FSDP2 blocks)", 20),
}
#: the limit of the dry run (all its parts in one process), which checks code on a CPU that other work may share
DRY_LIMIT_S = 600
DEVICE_SECONDS = 480


def run_part(key: str, out_dir: Path, dry: bool) -> dict:
    """Part ``key`` in a process (group) of its own, killed with its children at its budget."""
    return run_parts([key], out_dir, dry)[key]


#: the dry run's order in its one process: (f) counts every CPU tensor the process holds
DRY_ORDER = "fabcdeg"


def run_parts(keys: list[str], out_dir: Path, dry: bool) -> dict[str, dict]:
    """Parts ``keys`` in one process (group), killed with its children at the budget (its
    part's, or `DRY_LIMIT_S` in the dry run): per part what it saved, or its error."""
    budget = DRY_LIMIT_S if dry else sum(BUDGETS[k][1] for k in keys)
    cmd = [sys.executable, str(PARTS_SCRIPT), ",".join(keys), "--out-dir", str(out_dir)] + (
        ["--dry-run"] if dry else []
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    results = {k: out_dir / f"part_{k}.json" for k in keys}
    for result in results.values():
        result.unlink(missing_ok=True)  # what a part saves as it goes; never a former run's
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    t = time.perf_counter()
    try:
        log, _ = proc.communicate(timeout=budget)
        error, seconds = f"exit {proc.returncode}", time.perf_counter() - t
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        error, seconds = f"timed out after its {budget} s budget", budget
    out = {}
    for key, result in results.items():
        saved = json.loads(result.read_text()) if result.exists() else None
        if saved is not None and "part_error" in saved:  # raised; the process went on to its other parts
            raised = f"{saved['part_error']}\n{log[-2500:]}"
            out[key] = {"error": raised, "seconds": saved["part_seconds"], "partial": saved.get("partial")}
        elif saved is not None and "part_seconds" in saved:  # finished
            out[key] = {**saved, "seconds": saved["part_seconds"]}
            del out[key]["part_seconds"]
        else:  # killed or crashed in it: what it saved as it went
            out[key] = {"error": f"{error}\n{log[-2500:]}", "seconds": seconds, "partial": saved}
    return out


def write(out_dir: Path, meta: dict, results: dict) -> Path:
    stem = out_dir / f"device-check_{meta['hardware']}_{meta['date']}"
    lines = [
        f"# Device check — {meta['device_name']} — {meta['date']}",
        "",
        f"Command: `{meta['command']}`; torch {meta['torch']}, Python {meta['python']}; "
        f"{'DRY RUN on CPU with tiny sizes: checks the script, not the numbers' if meta['dry'] else 'GPU run'}.",
        "",
    ]
    for key, (title, _) in BUDGETS.items():
        res = results.get(key)
        lines += [f"## {title}", ""]
        if res is None:
            lines += ["not run", ""]
        elif "error" in res:
            lines += [f"FAILED after {res.get('seconds', 0):.0f} s:", "", "```", res["error"], "```", ""]
            if res.get("partial"):
                lines += ["What it measured before:", "", "```json", json.dumps(res["partial"], indent=1), "```", ""]
        elif "skipped" in res:
            lines += [res["skipped"], ""]
        elif key == "a":
            lines += [
                f"{res['seconds']:.0f} s; profile_device_check.py exit {res['returncode']}, report `{res['report']}`:",
                "",
                res["table"] or "```\n" + res["tail"] + "\n```",
                "",
            ]
        else:
            lines += [f"{res['seconds']:.0f} s:", "", "```json", json.dumps(res, indent=1, default=str), "```", ""]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, **results}, indent=1, default=str))
    return stem.with_suffix(".md")


def _meta(dry: bool, argv: list[str]) -> dict:
    if dry:
        name, hardware, version = platform.processor() or "cpu", "cpu", metadata.version("torch")
    else:
        import torch

        name, version = torch.cuda.get_device_name(0), torch.__version__
        hardware = next((h for h in ("h100", "h200") if h in name.lower()), name.lower().replace(" ", "-"))
    return {
        "date": dt.date.today().isoformat(),
        "hardware": hardware,
        "device_name": name,
        "dry": dry,
        "torch": version,
        "python": platform.python_version(),
        "command": " ".join(["benchmarks/tools/device_check.py", *argv]),
    }


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", "--out-dir", dest="out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--dry-run", action="store_true", help="every part on CPU / gloo at tiny sizes")
    ap.add_argument("--parts", default=",".join(BUDGETS), help="comma-separated parts to run, e.g. a,c")
    ap.add_argument("--jobs", type=int, default=1, help="parts run at once on the GPU (the dry run: one process)")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.parts.split(",") if k.strip()]
    bad = [k for k in keys if k not in BUDGETS]
    if bad:
        raise SystemExit(f"--parts {args.parts!r}: unknown part(s) {bad}; choose from {','.join(BUDGETS)}")
    if not args.dry_run and not _cuda():
        raise SystemExit("no CUDA device: run with --dry-run on CPU")
    total = sum(BUDGETS[k][1] for k in BUDGETS)
    assert total <= DEVICE_SECONDS, f"the GPU budgets add up to {total} s > {DEVICE_SECONDS} s"
    for k in keys:
        print(f"[device_check] part ({k}) budget {BUDGETS[k][1]} s on the GPU", file=sys.stderr)
    print(f"[device_check] GPU budgets of all parts: {total} s", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = _meta(args.dry_run, argv)
    old = args.out / f"device-check_{meta['hardware']}_{meta['date']}.json"
    results = {k: v for k, v in json.loads(old.read_text()).items() if k != "meta"} if old.exists() else {}
    # a rerun replaces its parts and keeps the others
    if args.dry_run:
        keys = sorted(keys, key=DRY_ORDER.index)
        results |= run_parts(keys, args.out, dry=True)
        path = write(args.out, meta, results)
    else:  # on the GPU one part at a time, each in its own process (they time the device)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            running = {pool.submit(run_part, key, args.out, False): key for key in keys}
            for done in concurrent.futures.as_completed(running):
                results[running[done]] = done.result()
                path = write(args.out, meta, results)
                print(f"[device_check] part ({running[done]}) done", file=sys.stderr, flush=True)
    print(path)
    return 0 if all("error" not in results[k] for k in keys) else 1


if __name__ == "__main__":
    raise SystemExit(main())
