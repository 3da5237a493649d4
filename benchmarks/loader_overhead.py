"""What the DataCentricLoader costs per optimizer step, next to a plain torch DataLoader that
hands out the very same steps (same sample ids per step) packed into one row.

    .venv/bin/python benchmarks/loader_overhead.py [--samples 3000] [--world 8] [--json out.json]

Data: synthetic token sequences made in ``__getitem__`` (an arithmetic sequence per sample,
as a tokenized-text reader would return), lengths log-uniform in [64, 8192], 64k tokens a
step. Plans: the analytic Llama-7B-like model on H200 nodes of 8 (the paper scale; the
planner does the same work whatever runs the model), rank 0 of `--world` ranks simulated
in this process (each rank loads and collates only its own group's micro-batches). The plain
baseline is rank 0 under DDP: every world-th sample of each step, packed into one row.
``--io-ms`` adds a sleep per sample read, standing for storage latency.

The dcparallel rows cover where planning runs: in the iterating thread (``lookahead=0``), in
the loader's planning process (``planning="process"``, the default, started before the
epoch as the trainer does), or in a background thread of this process (``planning="thread"``).

Measured, per step (median and mean over the epoch):
  plan      planner.plan() alone (in this thread; wall and processor time)
  iterate   next() of the loader with nothing else running (plan + load + collate)
  exposed   next() while the loop runs ~`--compute-ms` of torch compute per step (1 thread):
            what training waits for once planning (process or thread) and loading (workers)
            overlap with it.
Each in wall time and in the iterating thread's processor time (`timed_next`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import time

import torch
from torch.utils.data import DataLoader

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.data import DataCentricLoader
from dcparallel.plan.steps import form_steps
from dcparallel.spec import LLAMA_7B, h200_cluster


class SyntheticText(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seed: int = 0, io_ms: float = 0.0):
        rng = random.Random(seed)
        self.io_ms = io_ms
        self.lengths = [int(math.exp(rng.uniform(math.log(64), math.log(8192)))) for _ in range(num_samples)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.io_ms:
            time.sleep(self.io_ms / 1e3)  # stands for reading the sample from storage
        a, b = (i * 7919) % 32000, i % 13 + 1
        return (a + torch.arange(self.lengths[i]) * b) % 32000


def pack(samples: list[torch.Tensor]) -> dict:
    """The plain baseline's collate: one packed row + cu_seqlens + per-document positions."""
    row = torch.cat(samples)[None]
    cu = torch.tensor([0] + [len(s) for s in samples]).cumsum(0)
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    labels = torch.cat([torch.cat([s[1:], s.new_full((1,), -100)]) for s in samples])[None]
    return {"input_ids": row, "labels": labels, "positions": pos, "cu_seqlens": cu}


def compute(ms: float, x: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        x = x @ x
        x = x / x.norm()


def timed_next(it, compute_ms: float) -> tuple[list[float], list[float]]:
    """Wall seconds of each next(), and the processor seconds this (the iterating) thread spent
    in it: the second leaves out the planning thread or process and the DataLoader workers,
    and what other jobs on a loaded machine take from the wall."""
    x = torch.randn(256, 256)
    out, cpu = [], []
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            item = next(it)
        except StopIteration:
            return out, cpu
        out.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        del item
        if compute_ms:
            compute(compute_ms, x)


def stats(xs: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(xs), "mean_ms": 1e3 * statistics.fmean(xs), "steps": len(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--compute-ms", type=float, default=100.0)
    ap.add_argument("--policy", default="dcp")
    ap.add_argument("--io-ms", type=float, default=0.0, help="simulated read latency per sample (sleep)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    ds = SyntheticText(args.samples, io_ms=args.io_ms)
    cluster = h200_cluster(args.world, min(args.world, 8))
    cost = AnalyticCost(LLAMA_7B, cluster)
    steps = form_steps(ds.lengths, seed=0, tokens_per_step=args.tokens_per_step)
    results: dict = {
        "config": vars(args),
        "num_steps": len(steps),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }

    def dcp(**kw) -> DataCentricLoader:
        return DataCentricLoader(
            ds,
            ds.lengths,
            cost=cost,
            cluster=cluster,
            policy=args.policy,
            research=True,
            tokens_per_step=args.tokens_per_step,
            seed=0,
            rank=0,
            world_size=args.world,
            **kw,
        )

    # the plain per-rank baseline (as under DDP): rank 0 loads every world-th sample of the step
    share = [list(s.sample_ids)[0 :: args.world] for s in steps]
    results["tokens_per_rank_step"] = {"plain": statistics.fmean(sum(ds.lengths[i] for i in ids) for ids in share)}

    def plain(workers: int) -> DataLoader:
        return DataLoader(
            ds, batch_sampler=share, collate_fn=pack, num_workers=workers, prefetch_factor=4 if workers else None
        )

    t0 = time.perf_counter()
    loader = dcp(lookahead=0)
    results["build_s"] = time.perf_counter() - t0  # lengths, fit check, steps
    c = time.process_time()
    planner = loader.planner(0)  # built once per epoch: `dcp` tunes its static layouts here
    results["planner_build_cpu_s"] = time.process_time() - c
    plan_times, plan_cpu = [], []
    for s in loader.steps(0):
        t, c = time.perf_counter(), time.process_time()
        planner.plan(s)
        plan_times.append(time.perf_counter() - t)
        plan_cpu.append(time.process_time() - c)
    results["plan"] = stats(plan_times)
    results["plan_cpu"] = stats(plan_cpu)  # processor time: what a loaded machine inflates least
    loaded, held = [], []
    for p in loader.plans(0):
        work = p.work_of(0)
        loaded.append(sum(ds.lengths[i] for mb, _ in work for i in mb.sample_ids))
        # every rank of an SP group reads the whole samples, then keeps its shard
        held.append(sum(ds.lengths[i] / len(ranks) for mb, ranks in work for i in mb.sample_ids))
    results["tokens_per_rank_step"]["dcparallel_loaded"] = statistics.fmean(loaded)
    results["tokens_per_rank_step"]["dcparallel_shard"] = statistics.fmean(held)

    rows = []
    for name, make in [
        ("plain DataLoader, 0 workers", lambda: plain(0)),
        ("plain DataLoader, 2 workers", lambda: plain(2)),
        ("dcparallel, lookahead 0, 0 workers", lambda: dcp(lookahead=0, num_workers=0)),
        ("dcparallel, lookahead 2, thread, 0 workers", lambda: dcp(lookahead=2, planning="thread")),
        ("dcparallel, lookahead 2, process, 0 workers", lambda: dcp(lookahead=2, planning="process")),
        (
            "dcparallel, lookahead 2, process, 2 workers",
            lambda: dcp(lookahead=2, planning="process", num_workers=2, prefetch_factor=4),
        ),
    ]:
        for mode, ms in (("iterate", 0.0), ("exposed", args.compute_ms)):
            source = make()
            if isinstance(source, DataCentricLoader):
                source.start_planning()  # as the trainer does: not in step 1's time
            xs, cpu = timed_next(iter(source), ms)
            if isinstance(source, DataCentricLoader):
                source.close()
            rows.append({"loader": name, "mode": mode, **stats(xs), "thread_cpu": stats(cpu)})
            print(
                f"{name:44s} {mode:8s} median {rows[-1]['median_ms']:7.2f} ms  mean {rows[-1]['mean_ms']:7.2f} ms"
                f"  thread CPU median {rows[-1]['thread_cpu']['median_ms']:6.2f} ms  ({len(xs)} steps)",
                flush=True,
            )
    results["rows"] = rows
    print(
        f"plan alone: median {results['plan']['median_ms']:.2f} ms, mean {results['plan']['mean_ms']:.2f} ms "
        f"per step (CPU: median {results['plan_cpu']['median_ms']:.2f} ms); "
        f"build {results['build_s']:.2f} s, planner {results['planner_build_cpu_s']:.2f} CPU-s; {len(steps)} steps"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
