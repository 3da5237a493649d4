"""Gradient and optimizer-state bytes per rank, LoRA against full fine-tuning (CPU, gloo).

Spawns ``--world`` gloo ranks. For each variant (full fine-tuning in fp32; PEFT LoRA of rank
``--rank`` on every linear of the blocks, base fp32; the same with the frozen base in bf16)
and each shard size, builds a transformers Llama from its config (grouped-query attention),
wraps it in `DataCentricParallel`, trains one planned step of `prepare`'s loader (analytic
cost) and an optimizer step, then counts the bytes of the distinct storages behind this
rank's parameters, its gradient buffer and its AdamW state (two fp32 moments, and fp32
masters where the parameters are not fp32). Prints a markdown table.

    PYTHONPATH=$PWD python benchmarks/lora_state_bytes.py --world 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _storages(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t is None or t.numel() == 0:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _model(variant: str, rank: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**CONFIG), attn_implementation="sdpa")
    if variant == "full":
        return model
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LINEARS))
    if variant == "lora, bf16 base":
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


def _measure(variant: str, shard_size: int, rank: int) -> dict:
    import dcparallel

    model = _model(variant, rank)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dc = dcparallel.DataCentricParallel(model, shard_size=shard_size, memory_bytes=2**32, seed=0)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, CONFIG["vocab_size"], (int(n),), generator=g) for n in (96, 64, 160, 48, 200, 80)]
    loader = dc.prepare(
        [{"input_ids": d} for d in docs], lengths=[len(d) for d in docs], tokens_per_step=1024, cost="analytic"
    )
    opt = dc.optimizer(lr=1e-3)
    for batch in next(iter(loader)):
        with dc.micro_batch(batch) as ctx:
            ctx.backward(dc.loss_fn(dc.model, batch, ctx))
    loss = dc.sync_gradients()
    opt.step()
    state = [opt.exp_avg, opt.exp_avg_sq]
    master = getattr(opt, "master", None)
    if master is not None and master.data_ptr() != opt._param_shard.data_ptr():
        state.append(master)
    return {
        "variant": variant,
        "shard_size": shard_size,
        "rank": dist.get_rank(),
        "total": total,
        "trainable": trainable,
        "loss": loss,
        "params": _storages(list(dc.model.parameters())),
        "grads": _storages([dc.engine.grad_sync.flat_grad]),
        "optimizer": _storages(state),
    }


def _worker(rank: int, world: int, init: str, runs: list[tuple[str, int]], lora_rank: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        for variant, s in runs:
            q.put(_measure(variant, s, lora_rank))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--shard-sizes", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = [(v, s) for s in args.shard_sizes for v in ("full", "lora", "lora, bf16 base")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = os.path.join(tempfile.mkdtemp(), "rdv")
    procs = [ctx.Process(target=_worker, args=(r, args.world, init, runs, args.rank, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = [q.get(timeout=900) for _ in range(args.world * len(runs))]
    for p in procs:
        p.join()
    print(f"model: transformers Llama {CONFIG}; LoRA r={args.rank} on {', '.join(LINEARS)}; world {args.world}\n")
    print(
        "| shard_size | variant | rank | trainable / total parameters | params (MiB) | grads (B) | "
        "optimizer state (B) | grads + optimizer vs full | bytes per trainable parameter | step loss |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    full = {(r["shard_size"], r["rank"]): r["grads"] + r["optimizer"] for r in rows if r["variant"] == "full"}
    order = {v: i for i, (v, _) in enumerate(runs)}
    for r in sorted(rows, key=lambda x: (x["shard_size"], order[x["variant"]], x["rank"])):
        both = r["grads"] + r["optimizer"]
        print(
            f"| {r['shard_size']} | {r['variant']} | {r['rank']} | {r['trainable']:,} / {r['total']:,} | "
            f"{r['params'] / 2**20:.2f} | {r['grads']:,} | {r['optimizer']:,} | "
            f"{both / full[(r['shard_size'], r['rank'])]:.4f} | {both / r['trainable']:.2f} | {r['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
