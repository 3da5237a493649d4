"""GPU check of the fused attention kernels (issue 52): each case runs forward and backward
through `cuda_varlen_attention` (the kernel `attention_kernel` picks) and through the exact
per-document reference (`sdpa_attention`, fp32 copies of the same inputs), and prints the
kernel taken, the largest relative error of the output and of every gradient (q, k, v,
sinks), the time of one forward + backward of each, and the peak memory of each.

    PYTHONPATH=. python3 benchmarks/attention_kernels_check.py [--tokens 16384] [--dtype bf16]
    PYTHONPATH=. python3 benchmarks/attention_kernels_check.py --dry-run   # CPU, tiny: the script only

bf16 errors around 1e-2 relative are rounding; an error near 1 (or one gradient far from the
others) is a wrong kernel. Not a test: no assertion, a report to read.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dcparallel.models.attention import (
    AttnFeatures,
    AttnPattern,
    _torch_version,
    attention_kernel,
    cuda_varlen_attention,
    sdpa_attention,
)

#: (name, pattern, query heads, key/value heads, query/key head size, value head size, sinks)
CASES = [
    ("llama-gqa", AttnPattern("causal"), 16, 4, 128, 128, False),
    ("mistral-window", AttnPattern("causal", window=1024), 16, 4, 128, 128, False),
    ("gemma2-softcap", AttnPattern("causal", softcap=50.0), 16, 8, 128, 128, False),
    ("gpt-oss-sinks-window", AttnPattern("causal", window=128), 16, 2, 64, 64, True),
    ("gpt-oss-sinks", AttnPattern("causal"), 16, 2, 64, 64, True),
    ("deepseek-mla", AttnPattern("causal"), 16, 16, 192, 128, False),
    ("wan-full", AttnPattern("full"), 12, 12, 128, 128, False),
]


def _documents(tokens: int) -> tuple[int, ...]:
    """Packed documents of halving lengths, then 7 padding positions."""
    cu, left, n = [0], tokens - 7, tokens // 2
    while left > 0:
        cu.append(cu[-1] + min(max(n, 1), left))
        left, n = tokens - 7 - cu[-1], n // 2
    return tuple(cu)


def _run(fn, inputs, w, device):
    for t in inputs:
        t.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn(*inputs)
    (out.float() * w).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return out.detach().float(), [t.grad.float() for t in inputs], time.perf_counter() - start, peak


def check(case, tokens: int, dtype: torch.dtype, device: torch.device) -> dict:
    name, pattern, h, hkv, d, dv, use_sinks = case
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(1, tokens, h, d), (1, tokens, hkv, d), (1, tokens, hkv, dv)]
    base = [torch.randn(s, generator=g, device=device) for s in shapes] + \
        ([torch.randn(h, generator=g, device=device)] if use_sinks else [])
    cu = _documents(tokens)
    w = torch.randn(1, tokens, h, dv, generator=g, device=device)
    fast = [t.to(dtype, copy=True).requires_grad_() for t in base]
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    ref = [t.to(ref_dtype, copy=True).requires_grad_() for t in base]
    call = lambda kernel: lambda q, k, v, *s: kernel(q, k, v, pattern, cu, *s)  # noqa: E731
    features = AttnFeatures.of(fast[0], pattern, base[3] if use_sinks else None)
    row = {"case": name, "kernel": attention_kernel(device.type, dtype, features, _torch_version())}
    try:
        _run(call(cuda_varlen_attention), fast, w, device)  # compiles flex once
        out, grads, row["fused_s"], row["fused_gib"] = _run(call(cuda_varlen_attention), fast, w, device)
        r_out, r_grads, row["reference_s"], row["reference_gib"] = _run(call(sdpa_attention), ref, w, device)
        err = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
        row["err_out"] = err(out, r_out)
        for label, a, b in zip(("q", "k", "v", "sinks"), grads, r_grads, strict=False):
            row[f"err_d{label}"] = err(a, b)
    except Exception as exc:  # a report, not a test: say what failed and go on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--dry-run", action="store_true", help="CPU, 64 tokens: checks the script, not the kernels")
    a = p.parse_args()
    device = torch.device("cpu" if a.dry_run else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}["fp32" if a.dry_run else a.dtype]
    tokens = 64 if a.dry_run else a.tokens
    print(json.dumps({"torch": torch.__version__, "device": str(device), "tokens": tokens, "dtype": str(dtype)}))
    for case in CASES:
        print(json.dumps(check(case, tokens, dtype, device)), flush=True)


if __name__ == "__main__":
    main()
