"""Part (e) of the device check: the parameter-sharded runtime (`runtime.sharded`, FSDP2 in a
block of s ranks) on the GPUs of one node, s = the number of local GPUs; a torchrun worker.

    torchrun --nproc-per-node 8 benchmarks/tools/sharded_device_check.py --out result.json
    torchrun --nproc-per-node 2 benchmarks/tools/sharded_device_check.py --dry-run --out r.json  # CPU, gloo

(1) parity: the reference Llama in fp32, one step of micro-batches on SP groups of the whole
    block (uneven document lengths, recompute on the second micro-batch), sharded (s ranks) and
    replicated (shard size 1) engines side by side: loss and the worst relative error of any
    parameter's full gradient;
(2) storage and speed: a Llama-1B-like stack in bf16 at shard size s: parameter + gradient bytes
    per rank (fp32 shards) against the replicated recipe (the model's parameters + fp32
    gradients on every rank), the median step time of a few steps, and the peak memory (CUDA).

Rank 0 writes the JSON; device_check.py folds it into its report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _llama(dry: bool, big: bool):
    from dcparallel.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    if dry or not big:
        return Llama(LlamaConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=8, ffn_hidden=176))
    return Llama(LlamaConfig(vocab_size=32000, hidden=2048, num_layers=16, num_heads=16, ffn_hidden=5632))


def _step(engine, model, docs: dict, ranks: tuple, rank: int, recompute_last: bool) -> float:
    """One step: the documents in micro-batches of two on the group of every rank."""
    from dcparallel.data.collate import text_batch
    from dcparallel.loss import per_token_loss
    from dcparallel.plan.types import MicroBatch
    from dcparallel.spec import Layout, Recompute

    ids = sorted(docs)
    chunks = [tuple(ids[i : i + 2]) for i in range(0, len(ids), 2)]
    L = len(engine.layers)
    for j, mb in enumerate(chunks):
        rc = Recompute.full(L) if recompute_last and j == len(chunks) - 1 else Recompute.none()
        batch = text_batch(MicroBatch(mb, Layout(len(ranks), len(mb), rc)), ranks, rank, docs)
        batch = batch.to(engine.params[0].device)
        with engine.micro_batch(batch) as ctx:
            ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
            ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
    return engine.sync_gradients()


def run(dry: bool) -> dict:
    from dcparallel.runtime import comm
    from dcparallel.runtime.engine import Engine
    from dcparallel.runtime.launch import init_distributed

    launch = init_distributed("cpu" if dry else None)
    world, rank, dev = launch.world_size, launch.rank, launch.device
    s = world if dry else launch.local_world_size
    ranks = tuple(range(world))  # SP groups of whole blocks: here one group of every rank
    g = torch.Generator().manual_seed(1)
    out: dict = {"world": world, "shard_size": s, "device": str(dev), "backend": launch.backend}

    # (1) parity, fp32: sharded vs replicated, the same documents and micro-batches
    lengths = [37, 120, 64, 9, 200, 50] if dry else [500, 2048, 1300, 77, 4000, 900]
    docs = {i: torch.randint(0, 256, (n,), generator=g) for i, n in enumerate(lengths)}
    grads, losses = {}, {}
    for shard in (1, s):
        model = _llama(dry, big=False).to(dev)
        engine = Engine(model, layers=model.layers, num_heads=model.cfg.num_heads, shard_size=shard)
        losses[shard] = _step(engine, model, docs, ranks, rank, recompute_last=True)
        grads[shard] = {k: v.float().cpu() for k, v in engine.full_gradients().items()}
        del engine, model
    worst = max(float((grads[s][k] - v).norm() / v.norm().clamp_min(1e-30)) for k, v in grads[1].items())
    out["parity"] = {
        "loss_sharded": losses[s],
        "loss_replicated": losses[1],
        "max_rel_grad_err": worst,
        "tensors": len(grads[1]),
    }

    # (2) storage, step time and peak memory at shard size s, bf16 on the GPU
    model = _llama(dry, big=True).to(dev, torch.float32 if dry else torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    replicated = n * (next(model.parameters()).element_size() + 4)  # parameters + fp32 gradients, every rank
    engine = Engine(model, layers=model.layers, num_heads=model.cfg.num_heads, shard_size=s)
    opt = engine.optimizer(lr=1e-4)
    vocab = model.cfg.vocab_size
    big_docs = {
        i: torch.randint(0, vocab, (k,), generator=g)
        for i, k in enumerate([64, 100, 32, 80] if dry else [4096, 8192, 2048, 6000, 1024, 3000, 500, 7000])
    }
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(2 if dry else 4):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        _step(engine, model, big_docs, ranks, rank, recompute_last=False)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    store = engine.grad_sync.storage_bytes()
    out["storage"] = {
        "num_params": n,
        "param_bytes_per_rank": store["params"],
        "grad_bytes_per_rank": store["grads"],
        "replicated_param_grad_bytes": replicated,
        "fraction_of_replicated": (store["params"] + store["grads"]) / replicated,
    }
    out["step_s"] = sorted(times[1:])[len(times[1:]) // 2]
    out["tokens_per_step"] = sum(int(d.shape[0]) for d in big_docs.values())
    if dev.type == "cuda":
        out["peak_memory_bytes"] = max(comm.all_gather_object(torch.cuda.max_memory_allocated(dev)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU processes on gloo, tiny sizes")
    args = ap.parse_args(argv)
    res = run(args.dry_run)
    from dcparallel.runtime import comm

    if comm.world_rank() == 0:
        args.out.write_text(json.dumps(res, indent=1))
        print(json.dumps(res), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
