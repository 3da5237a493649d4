"""The attention seam between single-device models and the runtime.

A model calls ``attention(q, k, v, pattern)`` with ``q`` of shape (batch, tokens, heads,
head_dim) and ``k, v`` of shape (batch, tokens, kv_heads, head_dim / value_head_dim) —
kv_heads dividing heads (grouped-query attention); the value head size may differ from the
query/key one (multi-head latent attention) — and gets the output of shape (batch, tokens,
heads, value_head_dim). ``pattern`` says which tokens of a sample see which: causal (text),
full (video, 3D), or factorized spatial / temporal attention over a (frames, spatial
tokens) grid; its ``softcap`` caps the logits (``cap * tanh(logits / cap)``, Gemma 2).
``sinks`` (optional, one logit per query head, gpt-oss) add a learned column to each
softmax's denominator that takes part in normalization and is then dropped. Documents
packed in one row (``cu_seqlens``) never attend to each other, and positions at or after
``cu_seqlens[-1]`` are padding: they attend to nothing, nothing attends to them, and their
output is zero.

The runtime replaces the attention function (Ulysses); here is the plain kernel both use.
No torch.distributed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

PatternKind = Literal["causal", "full", "spatial", "temporal"]


@dataclass(frozen=True, slots=True)
class AttnPattern:
    """Which tokens of one sample attend to which.

    ``frames`` is the number of latent frames of a video sample (tokens = frames x spatial);
    only the factorized kinds use it: ``spatial`` attends within a frame, ``temporal``
    across frames at one spatial position."""

    kind: PatternKind
    frames: int = 1
    softcap: float | None = None
    """logit softcapping: scores ``s`` (already scaled) become ``softcap * tanh(s / softcap)``
    before masking and softmax; None = none"""

    def __post_init__(self) -> None:
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap {self.softcap} must be a positive number (or None for no capping)")

    @property
    def causal(self) -> bool:
        return self.kind == "causal"


class AttentionFn(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, sinks: Tensor | None = None
                 ) -> Tensor: ...


def _needs_eager(pattern: AttnPattern, sinks: Tensor | None) -> bool:
    """SDPA has neither logit softcapping nor sink logits: those go to `_eager`."""
    return pattern.softcap is not None or sinks is not None


def _eager(q: Tensor, k: Tensor, v: Tensor, causal: bool, softcap: float | None, sinks: Tensor | None) -> Tensor:
    """Attention written out, for what SDPA cannot do: (N, L, H, D) q, k (N, L, H_kv, D),
    v (N, L, H_kv, Dv) -> (N, L, H, Dv). Scores q.k / sqrt(D), then the softcap, the causal
    mask, the sink column (head h's logit ``sinks[h]``), a float32 softmax, the sink column
    dropped, @ v — the order of transformers' eager Gemma 2 and gpt-oss attention."""
    n, length, h, d = q.shape
    if k.shape[2] != h:  # consecutive query heads share a key/value head
        r = h // k.shape[2]
        k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    scores = torch.einsum("nlhd,nmhd->nhlm", q, k) * d**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        above = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if sinks is not None:
        col = sinks.to(scores.dtype).view(1, h, 1, 1).expand(n, h, length, 1)
        scores = torch.cat([scores, col], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("nhlm,nmhd->nlhd", probs.to(v.dtype), v)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """(N, L, H, D), k and v (N, L, H_kv, D) -> (N, L, H, D). SDPA gets 4-D (N, H, L, D)
    inputs: 3-D inputs take a 4-5x slower kernel on CPU. Fewer key/value heads than query
    heads (grouped-query attention) are shared by consecutive query heads."""
    kw = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, **kw
    )
    return out.transpose(1, 2)


def _attend_segment(q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, sinks: Tensor | None = None) -> Tensor:
    """Attention within one document / sample of length L: (B, L, H, Dv)."""
    if _needs_eager(pattern, sinks):
        core = lambda q, k, v, causal: _eager(q, k, v, causal, pattern.softcap, sinks)
    else:
        core = _sdpa
    if pattern.kind in ("causal", "full"):
        return core(q, k, v, pattern.causal)
    b, n, h, _ = q.shape
    dv = v.shape[-1]
    t = pattern.frames
    if t < 1 or n % t:
        raise ValueError(f"factorized attention over {n} tokens needs frames dividing it; got frames={t}")
    s = n // t
    if pattern.kind == "spatial":  # (B, T, S) -> (B*T, S)
        fold = lambda x: x.reshape(b * t, s, x.shape[2], x.shape[3])
        return core(fold(q), fold(k), fold(v), False).reshape(b, n, h, dv)
    if pattern.kind == "temporal":  # (B, T, S) -> (B*S, T)
        fold = lambda x: x.reshape(b, t, s, *x.shape[2:]).transpose(1, 2).reshape(b * s, t, *x.shape[2:])
        out = core(fold(q), fold(k), fold(v), False)
        return out.reshape(b, s, t, h, dv).transpose(1, 2).reshape(b, n, h, dv)
    raise ValueError(f"unknown attention pattern {pattern.kind!r}; use causal, full, spatial or temporal")


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, cu_seqlens: Sequence[int] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Reference kernel for full (unsharded) rows: a loop of SDPA per document (of the
    eager `_eager` when the pattern softcaps or ``sinks`` (H,) are given).

    ``cu_seqlens`` (same for every row) marks the documents; positions past its last entry
    are padding and get a zero output. ``None`` means one document filling the row."""
    length = q.shape[1]
    if cu_seqlens is None:
        cu_seqlens = (0, length)
    if (
        cu_seqlens[0] != 0
        or cu_seqlens[-1] > length
        or any(a > b for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
    ):
        raise ValueError(f"cu_seqlens {list(cu_seqlens)} must rise from 0 to at most the row length {length}")
    if len(cu_seqlens) == 2 and cu_seqlens[1] == length:
        return _attend_segment(q, k, v, pattern, sinks)
    pieces = [
        _attend_segment(q[:, a:b], k[:, a:b], v[:, a:b], pattern, sinks)
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)
        if b > a
    ]
    pad = length - cu_seqlens[-1]
    if pad:
        pieces.append(q.new_zeros(q.shape[0], pad, q.shape[2], v.shape[3]))
    return torch.cat(pieces, dim=1)


#: the dtypes varlen_attn's flash kernel takes ("FlashAttention only support fp16 and bf16")
VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def cuda_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, cu_seqlens: Sequence[int] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Packed causal documents on CUDA with ``torch.nn.attention.varlen.varlen_attn``
    (window (-1, 0) is causal); every other case, and every CPU tensor, goes to
    `sdpa_attention`: softcapping and sinks (its exact eager path; varlen_attn has neither),
    a value head size unlike the query/key one, factorized patterns, and dtypes other than
    `VARLEN_DTYPES` (its flash kernel raises on fp32; seen on an H200). varlen_attn raises
    NotImplementedError on CPU, so it is never called there."""
    if (not q.is_cuda or q.dtype not in VARLEN_DTYPES or pattern.kind not in ("causal", "full")
            or q.shape[0] != 1 or cu_seqlens is None or _needs_eager(pattern, sinks) or v.shape[-1] != q.shape[-1]):
        return sdpa_attention(q, k, v, pattern, cu_seqlens, sinks)
    varlen_attn = _varlen_attn()
    if k.shape[2] != q.shape[2]:  # not every varlen kernel takes grouped key/value heads
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    if varlen_attn is None:  # torch without the varlen API: the SDPA loop is exact, only slower
        return sdpa_attention(q, k, v, pattern, cu_seqlens)
    length = q.shape[1]
    real = cu_seqlens[-1]
    # every layer of a micro-batch has the same documents: one host-to-device copy for all
    cu, max_len = _cu_seqlens(tuple(cu_seqlens), q.device)
    out = varlen_attn(q[0, :real], k[0, :real], v[0, :real], cu, cu, max_len, max_len,
                      **_causal_kw(pattern.causal))
    if real < length:
        out = torch.cat([out, out.new_zeros(length - real, *out.shape[1:])], dim=0)
    return out.unsqueeze(0)


# the kernels here implement AttnPattern.softcap and sinks= exactly; a user's kernel declares
# the same by this attribute, else the runtime refuses a model that needs them
sdpa_attention.supports_softcap_and_sinks = True
cuda_varlen_attention.supports_softcap_and_sinks = True


@functools.cache
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _causal_kw(causal: bool) -> dict:
    """torch 2.10 spells causality `is_causal`; later releases a `window_size` of (-1, 0)
    (2.9 has no varlen_attn: `cuda_varlen_attention` runs the SDPA loop there)."""
    if "window_size" in inspect.signature(_varlen_attn()).parameters:
        return {"window_size": (-1, 0) if causal else (-1, -1)}
    return {"is_causal": causal}


@functools.lru_cache(maxsize=8)
def _cu_seqlens(cu_seqlens: tuple[int, ...], device: torch.device) -> tuple[Tensor, int]:
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    return cu, max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))


def default_kernel(device: torch.device):
    """SDPA on CPU, varlen_attn for packed causal text on CUDA."""
    return cuda_varlen_attention if device.type == "cuda" else sdpa_attention


def local_attention(q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, sinks: Tensor | None = None) -> Tensor:
    """Single-device default: every row is one whole sample (no packing, no padding)."""
    return default_kernel(q.device)(q, k, v, pattern, None, sinks)
