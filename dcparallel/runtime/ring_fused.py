"""A fused kernel for the ring's block attention: torch's memory-efficient SDPA on CUDA.

Ring attention (`runtime.ring`) needs, for each (query block, key block) pair, the output
normalized over that block's keys and its log-sum-exp (forward), and the gradients of the
pair's q, k, v under the whole softmax (backward: the merged output and log-sum-exp of every
block). torch's memory-efficient attention does both: its forward returns the log-sum-exp on
request, its backward takes the output and log-sum-exp the caller gives, from which it
rebuilds the probabilities exp(s - lse) and the row term rowsum(dO * O) — given the merged
ones, the pair's share of the whole softmax's gradient. The pair's mask becomes an additive
bias (0 or -inf), grouped-query key / value heads are repeated to the query heads (their
gradients summed back).

Used where the inputs allow (`fused_kernel`): a CUDA tensor, query / key / value head sizes
equal and a multiple of 8, a torch that has the ops (`compat.efficient_attention_ops`). The
fp32 path of `runtime.ring` stays the reference everywhere else (CPU). Rows that attend
nothing are fixed up from the mask, not from the kernel: output zero and log-sum-exp -inf
forward (kernels disagree there: 0, -inf or NaN), and a finite log-sum-exp backward (their
probabilities are exp(-inf - 0) = 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dcparallel.runtime import compat

#: rows of the memory-efficient kernel's log-sum-exp come in multiples of this
LSE_ROWS = 32
#: its additive bias' rows are stored in multiples of this many elements
BIAS_ALIGN = 16


@dataclass(frozen=True)
class FusedKernel:
    """An attention kernel in (B, H, L, D) layout with equal head counts: ``forward(q, k, v,
    bias, scale)`` -> (output, log-sum-exp (B, H, >= Lq)); ``backward(dout, q, k, v, bias,
    out, lse, scale)`` -> (dq, dk, dv), with ``out`` and ``lse`` (B, H, Lq) the whole
    softmax's."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def _cuda_kernel() -> FusedKernel | None:
    ops = compat.efficient_attention_ops()
    if ops is None:
        return None
    fwd, bwd = ops

    def forward(q, k, v, bias, scale):
        out, lse, _, _ = fwd(q, k, v, bias, True, 0.0, False, scale=scale)
        return out, lse

    def backward(dout, q, k, v, bias, out, lse, scale):
        padded = F.pad(lse, (0, -lse.shape[-1] % LSE_ROWS))  # the forward's row layout
        unused = torch.empty((), dtype=torch.long)  # the dropout state; no dropout here
        dq, dk, dv, _ = bwd(
            dout, q, k, v, bias, out, padded, unused, unused, 0.0, [True, True, True, False], False, scale=scale
        )
        return dq, dk, dv

    return FusedKernel("efficient-attention", forward, backward)


def fused_kernel(q: Tensor, k: Tensor, v: Tensor) -> FusedKernel | None:
    """The fused kernel for these block inputs (B, L, H, D), or None for the fp32 path."""
    d = q.shape[-1]
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    if k.shape[-1] != d or v.shape[-1] != d or d % 8 or not (q.dtype == k.dtype == v.dtype):
        return None
    return _cuda_kernel()


def _heads(x: Tensor, heads: int) -> Tensor:
    """(B, L, H_kv, D) -> (B, H, L, D), key / value heads repeated to ``heads``."""
    rep = heads // x.shape[2]
    return (x if rep == 1 else x.repeat_interleave(rep, dim=2)).transpose(1, 2)


def _bias(mask: Tensor, b: int, h: int, lq: int, lk: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """The mask (broadcasting to (B, 1, Lq, Lk)) as an additive bias (B, H, Lq, Lk) in the
    inputs' dtype, rows stored at `BIAS_ALIGN`; and (B, 1, Lq) whether each row sees a key."""
    full = torch.broadcast_to(mask.to(like.device), (b, 1, lq, lk))
    stored = -(-lk // BIAS_ALIGN) * BIAS_ALIGN
    bias = like.new_zeros(b, 1, lq, stored).narrow(-1, 0, lk)
    bias.masked_fill_(full.logical_not(), float("-inf"))
    return bias.expand(b, h, lq, lk), full.any(-1)


def fused_attend(
    kernel: FusedKernel, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """`ring.attend_block` through ``kernel``: q (B, Lq, H, D), k, v (B, Lk, H_kv, D) in
    their dtype -> output (B, Lq, H, D) and log-sum-exp (B, H, Lq), both fp32."""
    b, lq, h, _ = q.shape
    bias, sees = _bias(mask, b, h, lq, k.shape[1], q)
    out, lse = kernel.forward(q.transpose(1, 2), _heads(k, h), _heads(v, h), bias, scale)
    lse = lse.narrow(-1, 0, lq).float().masked_fill(sees.logical_not(), float("-inf"))
    out = out.float().masked_fill(sees.logical_not().unsqueeze(-1), 0.0)
    return out.transpose(1, 2), lse


def fused_grads(
    kernel: FusedKernel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """`ring.block_grads` through ``kernel``: the pair's dq (B, Lq, H, D), dk, dv (B, Lk,
    H_kv, D), fp32, under the whole softmax (``out`` (B, Lq, H, D) and ``lse`` (B, H, Lq)
    over every key)."""
    b, lq, h, _ = q.shape
    bias, _ = _bias(mask, b, h, lq, k.shape[1], q)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    dq, dk, dv = kernel.backward(
        dout.to(q.dtype).transpose(1, 2),
        q.transpose(1, 2),
        _heads(k, h),
        _heads(v, h),
        bias,
        out.to(q.dtype).transpose(1, 2),
        finite,
        scale,
    )
    kv, rep = k.shape[2], h // k.shape[2]

    def back(g: Tensor) -> Tensor:  # (B, H, Lk, D) -> (B, Lk, H_kv, D), repeated heads summed
        g = g.float().transpose(1, 2)
        return g if rep == 1 else g.reshape(*g.shape[:2], kv, rep, -1).sum(3)

    return dq.float().transpose(1, 2), back(dk), back(dv)
