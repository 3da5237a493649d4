"""What one micro-batch holds at its peak (forward + backward) against what the analytic cost
model predicts, for transformers families built from their configs (CPU, one process).

Each model is wrapped by `DataCentricParallel` (world 1) and runs one micro-batch of one
packed row of N tokens per ``--tokens`` through the runtime's own path
(``dc.micro_batch`` / ``dc.loss_fn`` / ``ctx.backward``), with the layout's recompute "none"
and "full" (the runtime's per-block checkpoints), under torch's MemTracker
(`torch.distributed._tools.mem_tracker`, each storage once). Measured: the peak bytes beyond
the parameters and their gradients. Predicted: `AnalyticCost.terms(...).memory(recompute)`
less the model states it counts (`AnalyticCost.model_state_bytes`: parameters, gradients,
optimizer states), the same quantity. Prints a markdown table.

    PYTHONPATH=$PWD python benchmarks/micro_batch_memory.py --tokens 256 1024 4096
"""

from __future__ import annotations

import argparse
import os

import torch

#: small configs of real families (transformers' own config classes), fp32, SDPA attention
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2),
    ),
    "llama-wide-mlp": (
        "LlamaConfig",
        dict(vocab_size=4096, hidden_size=256, intermediate_size=2048, num_hidden_layers=2),
    ),
}
COMMON = dict(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=False)


def build(family: str, dtype: torch.dtype = torch.float32):
    """``(model, dc)``: the family's model from its config and its `DataCentricParallel` (world 1)."""
    import transformers

    import dcparallel

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cls_name, cfg = FAMILIES[family]
    config = getattr(transformers, cls_name)(**cfg, **COMMON)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    return model, dcparallel.DataCentricParallel(model, memory_bytes=2**34)


def batch(dc, tokens: int, mode: str):
    """One micro-batch of one document of ``tokens`` tokens at recompute ``mode``, as the loader collates it."""
    from dcparallel.data.collate import resolve_collate
    from dcparallel.plan.types import MicroBatch
    from dcparallel.spec import Layout, Recompute

    g = torch.Generator().manual_seed(tokens)
    sample = {"input_ids": torch.randint(0, dc.spec.vocab_size, (tokens,), generator=g)}
    layout = Layout(1, 1, Recompute.static(mode, dc.spec.num_layers))
    return resolve_collate("text", "text")({0: sample}, MicroBatch((0,), layout), (0,), 0)


def measured(dc, model, mb) -> tuple[int, int]:
    """Bytes of the micro-batch beyond the model states: (at the end of the forward, at the
    peak of forward + backward). The states are the parameters and the runtime's fp32 gradient
    buffer (`runtime.grad_sync`, allocated before the micro-batch; tracked from the start so
    that it is left out whole, not counted from the first gradient added into it)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    grads = dc.engine.grad_sync.flat_grad

    def beyond(snap) -> int:
        return snap["Total"] - snap[_MemRefType.PARAM] - snap[_MemRefType.OTH]

    tracker, cpu, end = MemTracker(), torch.device("cpu"), []
    tracker.track_external(grads)
    with tracker, dc.micro_batch(mb) as ctx:
        loss = dc.loss_fn(model, mb, ctx)
        end.append(beyond(tracker.get_tracker_snapshot("current")[cpu]))
        assert tracker.get_tracker_snapshot("current")[cpu][_MemRefType.OTH] == grads.untyped_storage().nbytes()
        ctx.backward(loss)
    dc.zero_grad()
    return end[0], beyond(tracker.get_tracker_snapshot("peak")[cpu])


def predicted_peak(dc, tokens: int, mode: str) -> float:
    """The analytic model's peak of the micro-batch less the model states it counts
    (`AnalyticCost.model_state_bytes`: parameters, gradient buffer, optimizer states)."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.spec import Recompute, h200_cluster

    cost = AnalyticCost(dc.spec, h200_cluster(1))
    r = Recompute.static(mode, dc.spec.num_layers)
    return cost.terms([tokens], 1).memory(r) - cost.model_state_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{args.dtype} models, bytes beyond the model states\n")
    print("| family | tokens | recompute | end of forward (B) | peak (B) | predicted peak (B) | predicted / peak |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for family in args.families:
        model, dc = build(family, getattr(torch, args.dtype))
        for tokens in args.tokens:
            for mode in ("none", "full"):
                end, peak = measured(dc, model, batch(dc, tokens, mode))
                pred = predicted_peak(dc, tokens, mode)
                print(
                    f"| {family} | {tokens} | {mode} | {end:,} | {peak:,} | {pred:,.0f} | {pred / peak:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
