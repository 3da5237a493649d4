"""SP=1 vs SP=2 on CPU for one long sequence, and the cost of switching groups per step.

    torchrun --standalone --nproc-per-node 2 benchmarks/runtime_sp_cpu.py --lengths 2048 8192

Two ranks x one thread each (the machine has 2 cores). Every timing is the median of
``--repeats`` runs after one warm-up, between barriers, on rank 0, of a full training step
(forward, backward, the one gradient all-reduce; no optimizer step). The model is the
reference Llama at CPU-demo size (4 layers, hidden 256, 4 heads, vocab 4096).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dcparallel.data.collate import text_batch
from dcparallel.loss import per_token_loss
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime import comm
from dcparallel.runtime.engine import Engine
from dcparallel.spec import Layout


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--switch-steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run with --nproc-per-node 2"

    cfg = LlamaConfig.small()
    torch.manual_seed(0)
    model = Llama(cfg)
    dc = Engine(model, layers=model.layers, num_heads=cfg.num_heads)
    creation_ms = 1e3 * dc.groups.creation_seconds
    results: dict = {
        "world_size": world,
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "group_creation_ms": creation_ms,
        "sp": [],
    }

    def step(sample_ranks: tuple[int, ...], docs, sample_ids) -> None:
        sp = len(sample_ranks)
        if rank in sample_ranks:
            for sid in sample_ids:
                batch = text_batch(MicroBatch((sid,), Layout(sp, 1)), sample_ranks, rank, docs)
                with dc.micro_batch(batch) as ctx:
                    ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
                    ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
        dc.sync_gradients()

    for n in args.lengths:
        g = torch.Generator().manual_seed(n)
        docs = {
            0: torch.randint(0, cfg.vocab_size, (n,), generator=g),
            1: torch.randint(0, cfg.vocab_size, (n,), generator=g),
        }
        t_sp1 = timed(lambda d=docs: step((0,), d, [0]), args.repeats)  # rank 1 idle
        t_sp2 = timed(lambda d=docs: step((0, 1), d, [0]), args.repeats)
        t_dp2 = timed(lambda d=docs: step((rank,), d, [rank]), args.repeats)  # one sample per rank
        t_sp2x2 = timed(lambda d=docs: step((0, 1), d, [0, 1]), args.repeats)

        # the all-to-alls alone: per layer forward = 1 (q,k,v stacked) + 1 (output), the
        # backward mirrors them; shapes of this rank's shard
        group = dc.groups.group((0, 1))
        qkv = torch.randn(3, 1, n // 2, cfg.num_heads, cfg.head_dim)
        out = torch.randn(1, n, cfg.num_heads // 2, cfg.head_dim)

        def a2a(qkv=qkv, out=out, group=group) -> None:
            comm.seq_to_heads(list(qkv.unbind(0)), group)
            comm.heads_to_seq(out, group)

        t_a2a_layer = timed(a2a, args.repeats)
        row = {
            "tokens": n,
            "sp1_one_sample_s": t_sp1,
            "sp2_one_sample_s": t_sp2,
            "dp_two_samples_s": t_dp2,
            "sp2_two_samples_s": t_sp2x2,
            "a2a_per_layer_fwd_s": t_a2a_layer,
            "a2a_step_estimate_s": 2 * cfg.num_layers * t_a2a_layer,
        }
        results["sp"].append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)

    # Group switching: small steps (one 64-token sample per rank), either always in one
    # layout (all SP=2: both samples in the pair group; all SP=1: each rank its own sample)
    # or alternating SP=2 / SP=1 every step. Overhead of switching = alternating - mean of
    # the two fixed layouts.
    docs = {i: torch.randint(0, cfg.vocab_size, (64,)) for i in range(2)}

    def run_steps(pattern: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(args.switch_steps):
            sp2 = pattern == "sp2" or (pattern == "alternate" and s % 2 == 0)
            if sp2:
                step((0, 1), docs, [0, 1])
            else:
                step((rank,), docs, [rank])
        dist.barrier()
        return (time.perf_counter() - t0) / args.switch_steps

    run_steps("alternate")  # warm-up
    fixed_sp2 = statistics.median(run_steps("sp2") for _ in range(args.repeats))
    fixed_sp1 = statistics.median(run_steps("sp1") for _ in range(args.repeats))
    alternate = statistics.median(run_steps("alternate") for _ in range(args.repeats))

    # the bookkeeping of entering a micro-batch in another group (no compute, no collective)
    b2 = text_batch(MicroBatch((0,), Layout(2, 1)), (0, 1), rank, docs)
    b1 = text_batch(MicroBatch((0,), Layout(1, 1)), (rank,), rank, docs)
    t0 = time.perf_counter()
    for i in range(10000):
        with dc.micro_batch(b2 if i % 2 else b1):
            pass
    enter_us = 1e6 * (time.perf_counter() - t0) / 10000
    results["switch"] = {
        "steps": args.switch_steps,
        "fixed_sp2_step_s": fixed_sp2,
        "fixed_sp1_step_s": fixed_sp1,
        "alternating_step_s": alternate,
        "switch_overhead_per_step_s": alternate - (fixed_sp1 + fixed_sp2) / 2,
        "micro_batch_enter_exit_us": enter_us,
    }
    if rank == 0:
        print(json.dumps(results["switch"]), flush=True)
        print(f"group creation {creation_ms:.1f} ms", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
