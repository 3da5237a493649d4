"""Injects every fault of the reliability report into real `dcparallel train` runs under
torchrun (gloo, CPU) and measures: recovered?, samples lost / duplicated in the finished run,
time to recover, losses against an uninterrupted run. Prints a markdown table (and --json).

    PYTHONPATH=. python benchmarks/reliability.py --json benchmarks/reliability_cpu_2026-12-07.json

Time to recover = from the faulting rank's "fault" event to the "start" event of the run
that resumed (process restart by torchrun, re-import, rendezvous, checkpoint load, re-plan);
for the hang it includes the watchdog's timeout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.faults import launch as run_with_faults
from tests.faults import run_config

NUM_SAMPLES = 36
DATA_FILE = "__1_0.distcp"  # rank 1's tensors in a checkpoint (dcparallel.checkpoint's layout)


def write_config(tmp: Path, name: str, **train) -> tuple[Path, Path]:
    return run_config(tmp, name, NUM_SAMPLES, keep_checkpoints=3, **train)


def launch(cfg: Path, ranks: int = 2, fault: str = "", restarts: int = 0) -> tuple[int, float, str]:
    """`dcparallel train` with the faults of DCPARALLEL_FAULT (tests/faults.py installs them as
    its ``before_step`` hook)."""
    t0 = time.perf_counter()
    r = run_with_faults(cfg, ranks=ranks, fault=fault, restarts=restarts, timeout=600)
    return r.returncode, time.perf_counter() - t0, r.stderr


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]


def coverage(out: Path) -> tuple[int, int]:
    ids = [i for m in metrics(out) for i in m["sample_ids"]]
    return NUM_SAMPLES - len(set(ids)), len(ids) - len(set(ids))


def loss_diff(out: Path, ref: list[dict]) -> float:
    got = metrics(out)
    if [m["global_step"] for m in got] != [m["global_step"] for m in ref]:
        return float("inf")
    return max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, ref))


def recovery_times(out: Path) -> list[float]:
    ev = events(out)
    times = []
    for i, e in enumerate(ev):
        if e["event"] == "fault":
            nxt = next((x for x in ev[i + 1 :] if x["event"] == "start"), None)
            times.append(nxt["time"] - e["time"] if nxt else float("nan"))
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dcp-reliability-"))
    rows = []
    cfg, ref_out = write_config(tmp, "ref")
    rc, wall, _ = launch(cfg)
    assert rc == 0
    ref = metrics(ref_out)
    rows.append(
        {
            "fault": "none (reference, 2 ranks)",
            "recovered": rc == 0,
            "lost": coverage(ref_out)[0],
            "duplicated": coverage(ref_out)[1],
            "recover_s": [],
            "loss_rel_diff": 0.0,
            "wall_s": wall,
        }
    )

    for kind, spec in (
        ("kill (rank 1 os._exit at step 3)", "exit@3:1"),
        ("raise (rank 0 RuntimeError at step 6)", "raise@6:0"),
        ("hang (rank 1 sleeps at step 7; 6 s watchdog)", "hang@7:1"),
    ):
        cfg, out = write_config(tmp, spec.replace("@", "_").replace(":", "_"))
        rc, wall, _ = launch(cfg, fault=spec, restarts=1)
        lost, dup = coverage(out)
        rows.append(
            {
                "fault": kind,
                "recovered": rc == 0,
                "lost": lost,
                "duplicated": dup,
                "recover_s": recovery_times(out),
                "loss_rel_diff": loss_diff(out, ref),
                "wall_s": wall,
            }
        )

    # torn and mixed-step checkpoints: a run stopped at step 6 (checkpoints 2, 4, 6), the newest
    # broken in rank 1's torch.distributed.checkpoint data file
    for kind in (
        f"torn checkpoint (newest {DATA_FILE} truncated)",
        f"mixed-step files (newest {DATA_FILE} from step 4)",
    ):
        cfg, out = write_config(tmp, "torn" if kind.startswith("torn") else "mixed", max_steps=6)
        assert launch(cfg)[0] == 0
        f6, f4 = out / f"checkpoint/step_00000006/{DATA_FILE}", out / f"checkpoint/step_00000004/{DATA_FILE}"
        if kind.startswith("torn"):
            f6.write_bytes(f6.read_bytes()[:1000])
        else:
            shutil.copy(f4, f6)
        cfg.write_text(cfg.read_text().replace("max_steps = 6\n", ""))
        t0 = time.time()
        rc, wall, err = launch(cfg)
        start = next(e for e in events(out) if e["event"] == "start" and e["time"] > t0)
        lost, dup = coverage(out)
        rows.append(
            {
                "fault": kind,
                "recovered": rc == 0 and start["step"] == 4,
                "lost": lost,
                "duplicated": dup,
                "recover_s": [start["time"] - t0],
                "loss_rel_diff": loss_diff(out, ref),
                "wall_s": wall,
                "note": f"resumed from step {start['step']}",
            }
        )

    # world 4 -> 2 -> 4
    cfg, out = write_config(tmp, "elastic", max_steps=2)
    walls, ok = [], True
    for ranks, steps in ((4, 2), (2, 4), (4, None)):
        text = cfg.read_text()
        text = "\n".join(x for x in text.splitlines() if not x.startswith("max_steps")) + "\n"
        if steps:
            text = text.replace("[train]\n", f"[train]\nmax_steps = {steps}\n")
        cfg.write_text(text)
        t0 = time.time()
        rc, wall, _ = launch(cfg, ranks=ranks)
        ok &= rc == 0
        walls.append(wall)
    lost, dup = coverage(out)
    rows.append(
        {
            "fault": "world 4 -> 2 -> 4 (stopped after steps 2 and 4)",
            "recovered": ok,
            "lost": lost,
            "duplicated": dup,
            "recover_s": [],
            "loss_rel_diff": loss_diff(out, ref),
            "wall_s": sum(walls),
            "note": f"world sizes {[m['world_size'] for m in metrics(out)]}",
        }
    )

    print(
        "| fault | recovered | samples lost | samples duplicated | time to recover (s) | max rel. loss diff "
        "vs reference | launch wall (s) | note |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rec = ", ".join(f"{x:.1f}" for x in r["recover_s"]) or "-"
        print(
            f"| {r['fault']} | {'yes' if r['recovered'] else 'NO'} | {r['lost']} | {r['duplicated']} | {rec} | "
            f"{r['loss_rel_diff']:.2e} | {r['wall_s']:.1f} | {r.get('note', '')} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
