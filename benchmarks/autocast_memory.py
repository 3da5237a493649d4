"""What a forward under ``torch.autocast(dtype=bfloat16)`` adds to a micro-batch's memory on an
fp32 model, against the planner's accounting (CPU, one process).

Builds a transformers Llama from its config, wraps it in `DataCentricParallel` (world 1,
``autocast=torch.bfloat16``: the HF Trainer's ``bf16=True``) and runs one micro-batch of one
packed row of N tokens per ``--tokens``, with and without autocast, forward under autocast and
backward outside it (as the Trainer does), under torch's MemTracker: bytes beyond the
parameters at the end of the forward and at the peak of forward + backward. Beside them, the
profiler's CPU meter (`profile.shards.meter`: saved activations, autocast's weight copies
excluded) and the copies the planner counts (`StateRecipe.autocast`: 2 bytes per cast
parameter, `runtime.autocast.cast_params`). Prints a markdown table.

    PYTHONPATH=$PWD python benchmarks/autocast_memory.py --tokens 32 128 512 2048
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _held(dc, model, batch, autocast: bool) -> tuple[int, int]:
    """(bytes beyond the parameters at the end of the forward, at the peak of the micro-batch)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    tracker, end = MemTracker(), []
    cpu = torch.device("cpu")
    with tracker, dc.micro_batch(batch) as ctx:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = dc.loss_fn(model, batch, ctx)
        end.append(tracker.get_tracker_snapshot("current")[cpu])
        ctx.backward(loss)
    dc.zero_grad()
    peak = tracker.get_tracker_snapshot("peak")[cpu]
    return (
        end[0]["Total"] - end[0][_MemRefType.PARAM],
        peak["Total"] - peak[_MemRefType.PARAM],
    )


def _meter(dc, model, batch, autocast: bool) -> int:
    from dcparallel.profile import shards

    meter = shards.meter(dc.engine, 0.0, None)
    with dc.micro_batch(batch) as ctx, meter:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            dc.loss_fn(model, batch, ctx)
    dc.zero_grad()
    return meter.bytes


def _batch(dc, tokens: int):
    """One micro-batch of one document of ``tokens`` tokens, collated as the loader does."""
    from dcparallel.data.collate import resolve_collate
    from dcparallel.plan.types import MicroBatch
    from dcparallel.spec import Layout, Recompute

    g = torch.Generator().manual_seed(tokens)
    sample = {"input_ids": torch.randint(0, CONFIG["vocab_size"], (tokens,), generator=g)}
    layout = Layout(1, 1, Recompute.static("none", CONFIG["num_hidden_layers"]))
    return resolve_collate("text", "text")({0: sample}, MicroBatch((0,), layout), (0,), 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 512, 2048])
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    import dcparallel
    from dcparallel.cost.base import state_recipe

    model = LlamaForCausalLM._from_config(LlamaConfig(**CONFIG), attn_implementation="sdpa")
    dc = dcparallel.DataCentricParallel(model, memory_bytes=2**32, autocast=torch.bfloat16)
    copies = state_recipe(dc.spec, 1).autocast
    n = sum(p.numel() for p in model.parameters())
    print(f"model: transformers Llama {CONFIG}; {n:,} parameters, {dc.spec.autocast_params:,} cast by autocast")
    print(f"counted copies (StateRecipe.autocast): {copies:,.0f} B\n")
    cols = ["tokens", "end of forward, fp32 (B)", "end of forward, autocast (B)", "meter, fp32"]
    cols += ["meter, autocast + copies", "peak, fp32 (B)", "peak, autocast (B)", "autocast adds at peak (B)"]
    print("| " + " | ".join([*cols, "adds / copies"]) + " |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tokens in args.tokens:
        batch = _batch(dc, tokens)
        (end32, peak32), (end16, peak16) = _held(dc, model, batch, False), _held(dc, model, batch, True)
        m32, m16 = _meter(dc, model, batch, False), _meter(dc, model, batch, True) + copies
        print(
            f"| {tokens} | {end32:,} | {end16:,} | {m32:,} | {m16:,.0f} | {peak32:,} | {peak16:,} | "
            f"{peak16 - peak32:+,} | {(peak16 - peak32) / copies:+.2f} |"
        )


if __name__ == "__main__":
    main()
