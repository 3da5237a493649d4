"""How long `prepare` profiles the three examples at world 2 on this machine.

Each example runs twice under `torchrun --nproc-per-node 2`: with an empty output folder
(profiles, then trains) and again (reuses the cached profile, trains the same steps). The
difference of the two wall times is the profiling time (the training part is identical; the
difference includes nothing else). Writes a dated markdown report.

    .venv/bin/python benchmarks/profile_examples.py --out benchmarks/profile-examples_cpu_DATE.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"hf_llama": {}, "diffusers_wan": {"EPOCHS": "1"}, "custom_model": {}}


def launch(name: str, out_dir: Path, env: dict) -> tuple[float, str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / f"{name}.py"),
    ]
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd,
        env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", OUT_DIR=str(out_dir), **env),
        capture_output=True,
        text=True,
        cwd=out_dir,
    )
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / f"benchmarks/profile-examples_cpu_{date.today()}.md")
    ap.add_argument("--examples", default=",".join(EXAMPLES))
    args = ap.parse_args()
    rows = []
    for name in args.examples.split(","):
        with tempfile.TemporaryDirectory() as d:
            fresh, _ = launch(name, Path(d), EXAMPLES[name])
            cached, stdout = launch(name, Path(d), EXAMPLES[name])
            profile = next(Path(d).glob(f"{name}_profile*.json"))
            entries = len(json.loads(profile.read_text())["entries"])
        rows.append(
            {
                "example": name,
                "fresh_s": fresh,
                "cached_s": cached,
                "profile_s": fresh - cached,
                "layouts": entries,
                "steps": stdout.count("loss "),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()
    lines = [
        f"# Profiling the examples at world 2 (CPU), {date.today()}",
        "",
        f"Command: `.venv/bin/python benchmarks/profile_examples.py` · torch {torch.__version__} · "
        f"Python {platform.python_version()} · {os.cpu_count()} cores · load average at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}",
        "",
        "Each example launched twice with 2 gloo ranks: a fresh output folder (profile + train), then again "
        "(cached profile + the same training). Profiling time = the difference.",
        "",
        "| example | fresh launch s | cached launch s | profiling s | layouts measured | steps |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| `{r['example']}` | {r['fresh_s']:.1f} | {r['cached_s']:.1f} | {r['profile_s']:.1f} | "
            f"{r['layouts']} | {r['steps']} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
