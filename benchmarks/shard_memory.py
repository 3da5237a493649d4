"""Parameter, gradient and optimizer-state storage per rank at shard_size 1, 2, 4 (CPU, gloo).

Spawns ``--world`` gloo ranks; for each shard size builds the reference Llama (a few million
parameters), wraps it in an `Engine(shard_size=s)`, runs one step (a whole-world micro-batch
of one sample, so every shard size computes the same thing) and an optimizer step, then
counts the bytes of the distinct storages behind this rank's parameters, its gradients and
its optimizer state (storages shared by several tensors counted once). Prints a markdown table.

    PYTHONPATH=$PWD python benchmarks/shard_memory.py --world 4
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _storages(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.numel() == 0:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _measure(shard_size: int, cfg: dict) -> dict:
    from dcparallel.data.collate import text_batch
    from dcparallel.loss import shift_labels
    from dcparallel.models.llama import Llama, LlamaConfig
    from dcparallel.plan.types import MicroBatch
    from dcparallel.runtime.engine import Engine
    from dcparallel.spec import Layout

    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny(**cfg))
    world, rank = dist.get_world_size(), dist.get_rank()
    num_params = sum(p.numel() for p in model.parameters())
    dc = Engine(model, layers=model.layers, num_heads=cfg["num_heads"], shard_size=shard_size)
    opt = dc.optimizer(lr=1e-3)
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(0, cfg["vocab_size"], (64,), generator=g)
    mb = MicroBatch((0,), Layout(world, 1))
    batch = text_batch(mb, tuple(range(world)), rank, {0: doc}, {0: shift_labels(doc)})
    with dc.micro_batch(batch) as ctx:
        ctx.backward(ctx.lm_loss(dc.model(batch.inputs, batch.positions)))
    loss = dc.sync_gradients()
    opt.step()
    params = [p for p in dc.model.parameters()]
    if shard_size > 1:
        grads = [dc.grad_sync.flat_grad]
        state = [opt.exp_avg, opt.exp_avg_sq]
    else:
        grads = [dc.flat_grad]
        state = [opt.exp_avg, opt.exp_avg_sq] + ([] if opt.master is opt._param_shard else [opt.master])
    return {
        "shard_size": shard_size,
        "rank": rank,
        "num_params": num_params,
        "loss": loss,
        "params": _storages(params),
        "grads": _storages(grads),
        "optimizer": _storages(state),
    }


def _worker(rank: int, world: int, init: str, sizes: list[int], cfg: dict, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        for s in sizes:
            q.put(_measure(s, cfg))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--shard-sizes", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    cfg = {"num_layers": 4, "num_heads": 4, "hidden": 256, "ffn_hidden": 688, "vocab_size": 4096}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = os.path.join(tempfile.mkdtemp(), "rdv")
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, init, args.shard_sizes, cfg, q)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    rows = [q.get(timeout=600) for _ in range(args.world * len(args.shard_sizes))]
    for p in procs:
        p.join()
    mib = 2**20
    base = {}
    print(f"model: reference Llama {cfg}, {rows[0]['num_params']:,} parameters, fp32; world {args.world}\n")
    print("| shard_size | rank | params (MiB) | grads (MiB) | params+grads vs s=1 | optimizer state (MiB) | loss |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in sorted(rows, key=lambda x: (x["shard_size"], x["rank"])):
        pg = r["params"] + r["grads"]
        base.setdefault(r["rank"], pg)
        print(
            f"| {r['shard_size']} | {r['rank']} | {r['params'] / mib:.3f} | {r['grads'] / mib:.3f} | "
            f"{pg / base[r['rank']]:.3f} | {r['optimizer'] / mib:.3f} | {r['loss']:.6f} |"
        )


if __name__ == "__main__":
    main()
