"""The attention seam between single-device models and the runtime.

A model calls ``attention(q, k, v, pattern)`` with ``q`` of shape (batch, tokens, heads,
head_dim) and ``k, v`` of shape (batch, tokens, kv_heads, head_dim / value_head_dim) —
kv_heads dividing heads (grouped-query attention); the value head size may differ from the
query/key one (multi-head latent attention) — and gets the output of shape (batch, tokens,
heads, value_head_dim). ``pattern`` says which tokens of a sample see which: causal (text),
full (video, 3D), or factorized spatial / temporal attention over a (frames, spatial
tokens) grid; its ``softcap`` caps the logits (``cap * tanh(logits / cap)``, Gemma 2), its
``window`` limits causal attention to the latest keys (sliding windows) and its ``blocks``
make spans of the row bidirectional inside themselves (Gemma 3's images).
``sinks`` (optional, one logit per query head, gpt-oss) add a learned column to each
softmax's denominator that takes part in normalization and is then dropped. Documents
packed in one row (``cu_seqlens``) never attend to each other, and positions at or after
``cu_seqlens[-1]`` are padding: they attend to nothing, nothing attends to them, and their
output is zero.

The runtime replaces the attention function (Ulysses); here are the kernels both use:
`attention_kernel` picks one per call (fused on CUDA, the exact per-document reference on
CPU). No torch.distributed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dcparallel.models.flex import device_cu, flex_packed, pad_head

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
    window: int | None = None
    """causal sliding window: a query sees the ``window`` latest keys of its document, itself
    included (transformers' ``sliding_window``: key > query - window); None = all earlier keys"""
    blocks: tuple[tuple[int, int], ...] = ()
    """bidirectional spans [start, end) of row positions (Gemma 3's image token blocks): a
    query inside a span also sees the span's later keys, so it sees (causal OR same span) AND
    within the window (transformers' Gemma 3 masks); empty = none"""

    def __post_init__(self) -> None:
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap {self.softcap} must be a positive number (or None for no capping)")
        if self.window is not None and (self.kind != "causal" or not self.window >= 1):
            raise ValueError(
                f"attention window {self.window} with kind {self.kind!r}: a sliding window is a "
                f"positive number of keys of causal attention; use kind 'causal' or window None"
            )
        if self.blocks and self.kind != "causal":
            raise ValueError(
                f"bidirectional blocks {list(self.blocks)} with kind {self.kind!r}: blocks open spans of "
                f"causal attention; use kind 'causal' or no blocks"
            )

    def within(self, start: int, end: int) -> AttnPattern:
        """This pattern for the document [start, end) of the row: its blocks cut to it and
        counted from its start."""
        if not self.blocks:
            return self
        cut = tuple((max(a, start) - start, min(b, end) - start) for a, b in self.blocks if a < end and b > start)
        return dataclasses.replace(self, blocks=cut)

    @property
    def causal(self) -> bool:
        return self.kind == "causal"


class AttentionFn(Protocol):
    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, sinks: Tensor | None = None
    ) -> Tensor: ...


def _needs_eager(pattern: AttnPattern, sinks: Tensor | None) -> bool:
    """SDPA has neither logit softcapping nor sink logits: those go to `_eager`."""
    return pattern.softcap is not None or sinks is not None


def _masked(length: int, window: int | None, device: torch.device, blocks: tuple[tuple[int, int], ...] = ()) -> Tensor:
    """(L, L) True where a query may not see a key: later keys (but those of the query's own
    block), and keys ``window`` or more back."""
    idx = torch.arange(length, device=device)
    back = idx[:, None] - idx[None, :]
    hidden = back < 0
    for a, b in blocks:
        hidden[a:b, a:b] = False
    return hidden if window is None else hidden | (back >= window)


def _eager(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    softcap: float | None,
    sinks: Tensor | None,
    window: int | None = None,
    blocks: tuple[tuple[int, int], ...] = (),
) -> Tensor:
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
        scores = scores.masked_fill(_masked(length, window, q.device, blocks), float("-inf"))
    if sinks is not None:
        col = sinks.to(scores.dtype).view(1, h, 1, 1).expand(n, h, length, 1)
        scores = torch.cat([scores, col], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("nhlm,nmhd->nlhd", probs.to(v.dtype), v)


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None = None, blocks: tuple[tuple[int, int], ...] = ()
) -> Tensor:
    """(N, L, H, D), k and v (N, L, H_kv, D) -> (N, L, H, D). SDPA gets 4-D (N, H, L, D)
    inputs: 3-D inputs take a 4-5x slower kernel on CPU. Fewer key/value heads than query
    heads (grouped-query attention) are shared by consecutive query heads. A sliding window
    goes in as a boolean mask (True = attend), and so do bidirectional blocks."""
    kw = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    if blocks or (window is not None and window < q.shape[1]):
        kw["attn_mask"] = ~_masked(q.shape[1], window, q.device, blocks)
    else:
        kw["is_causal"] = causal
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    return out.transpose(1, 2)


def _attend_segment(q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, sinks: Tensor | None = None) -> Tensor:
    """Attention within one document / sample of length L: (B, L, H, Dv)."""
    if _needs_eager(pattern, sinks):
        core = lambda q, k, v, causal, window=None, blocks=(): _eager(
            q, k, v, causal, pattern.softcap, sinks, window, blocks
        )
    else:
        core = _sdpa
    if pattern.kind in ("causal", "full"):
        return core(q, k, v, pattern.causal, pattern.window, pattern.blocks)
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
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttnPattern,
    cu_seqlens: Sequence[int] | None = None,
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
    # `split`, not a slice per document: a slice's backward writes its gradient into a zero
    # tensor of the whole row, so a row of D documents would cost D rows of memory traffic
    # (a packed CPU micro-batch of 50 documents: attention forward + backward 1.7-1.9x slower)
    pad = length - cu_seqlens[-1]
    bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
    parts = [b - a for a, b in bounds] + [pad]
    qs, ks, vs = (x.split(parts, dim=1) for x in (q, k, v))
    pieces = [
        _attend_segment(qs[i], ks[i], vs[i], pattern.within(a, b), sinks) for i, (a, b) in enumerate(bounds) if b > a
    ]
    if pad:
        pieces.append(q.new_zeros(q.shape[0], pad, q.shape[2], v.shape[3]))
    return torch.cat(pieces, dim=1)


#: the dtypes varlen_attn's flash kernel takes ("FlashAttention only support fp16 and bf16")
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
#: the first torch releases with `varlen_attn`, with its ``window_size`` (sliding windows), and
#: with a FlexAttention whose backward takes the log-sum-exp's gradient (the sinks' rescale)
VARLEN_MIN, VARLEN_WINDOW_MIN, FLEX_MIN = (2, 9), (2, 11), (2, 9)

KernelName = Literal["varlen", "flex", "loop", "eager"]


@dataclass(frozen=True, slots=True)
class AttnFeatures:
    """What one attention call asks of a kernel: the inputs of `attention_kernel`."""

    kind: PatternKind
    softcap: bool = False
    sinks: bool = False
    window: bool = False
    one_row: bool = True
    """one packed row (batch 1): what varlen_attn takes; several rows go to one SDPA call"""
    blocks: bool = False
    """bidirectional blocks (Gemma 3's images): only the per-document reference computes them"""

    @classmethod
    def of(cls, q: Tensor, pattern: AttnPattern, sinks: Tensor | None) -> AttnFeatures:
        return cls(
            pattern.kind,
            pattern.softcap is not None,
            sinks is not None,
            pattern.window is not None,
            q.shape[0] == 1,
            bool(pattern.blocks),
        )


def attention_kernel(
    device_type: str, dtype: torch.dtype, features: AttnFeatures, torch_version: tuple[int, int]
) -> KernelName:
    """Which kernel computes a call. ``varlen``: varlen_attn over the packed documents (flash;
    grouped key/value heads as they are, a smaller value head zero-padded); ``flex``:
    FlexAttention with a document block mask, the softcap as a score mod and the sinks as an
    exact rescale by its log-sum-exp; ``loop``: SDPA per document (one call for rows of one
    document each); ``eager``: scores written out per document. CPU has no varlen_attn and
    no FlexAttention backward: the loop and eager path are the exact reference there, and on
    every device for bidirectional blocks (a boolean mask per document)."""
    needs_mod = features.softcap or features.sinks
    fallback: KernelName = "eager" if needs_mod else "loop"
    if device_type != "cuda" or features.kind not in ("causal", "full") or features.blocks:
        return fallback  # factorized kinds fold into rows: one call per fold
    if needs_mod or (features.window and torch_version < VARLEN_WINDOW_MIN):
        return "flex" if torch_version >= FLEX_MIN else fallback
    if dtype not in VARLEN_DTYPES or not features.one_row or torch_version < VARLEN_MIN:
        return "loop"
    return "varlen"


#: the kernels that run one call per document of a packed row (`sdpa_attention`'s loop)
PER_DOCUMENT_KERNELS = frozenset({"loop", "eager"})


def kernel_calls(kernel: KernelName, documents: int) -> int:
    """Kernel calls one attention sub-block makes on a packed row of ``documents`` documents:
    one per document on the SDPA loop and the eager path (`sdpa_attention`), one on
    varlen_attn and FlexAttention (the documents as one call's ``cu_seqlens`` / block mask).
    The analytic cost model charges each call's fixed cost (`profile.cpu_calibration`)."""
    return documents if kernel in PER_DOCUMENT_KERNELS else 1


def cuda_varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttnPattern,
    cu_seqlens: Sequence[int] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """dcparallel's kernel on any device: `attention_kernel` picks varlen_attn, FlexAttention,
    the SDPA loop or the eager path (`sdpa_attention` runs the last two)."""
    choice = attention_kernel(_device_type(q), q.dtype, AttnFeatures.of(q, pattern, sinks), _torch_version())
    length = q.shape[1]
    cu = (0, length) if cu_seqlens is None else cu_seqlens
    if choice == "varlen":
        return _varlen(q, k, v, pattern, cu)
    if choice == "flex":
        return _flex(q, k, v, pattern, cu, sinks)
    return sdpa_attention(q, k, v, pattern, cu_seqlens, sinks)


# the kernels here implement AttnPattern.softcap / .window and sinks= exactly; a user's kernel
# declares the same by these attributes, else the runtime refuses a model that needs them
sdpa_attention.supports_softcap_and_sinks = True
cuda_varlen_attention.supports_softcap_and_sinks = True
sdpa_attention.supports_window = True
cuda_varlen_attention.supports_window = True
sdpa_attention.supports_blocks = True
cuda_varlen_attention.supports_blocks = True


def _device_type(q: Tensor) -> str:
    return "cuda" if q.is_cuda else q.device.type


@functools.cache
def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _varlen(q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, cu: Sequence[int]) -> Tensor:
    """One packed row through varlen_attn: (1, L, H, D) -> (1, L, H, Dv), padding zero."""
    varlen_attn = _varlen_attn()
    length, d, dv = q.shape[1], q.shape[-1], v.shape[-1]
    v = pad_head(v, d)
    kw = dict(_window_kw(pattern.causal, pattern.window))
    if k.shape[2] != q.shape[2]:
        if "enable_gqa" in _varlen_params():
            kw["enable_gqa"] = True  # key/value heads reach the kernel with their own count
        else:
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    real = cu[-1]
    max_len = max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))  # host ints: no device read
    cu_t = device_cu(cu, q.device)
    out = varlen_attn(q[0, :real], k[0, :real], v[0, :real], cu_t, cu_t, max_len, max_len, **kw)[..., :dv]
    if real < length:
        out = torch.cat([out, out.new_zeros(length - real, *out.shape[1:])], dim=0)
    return out.unsqueeze(0)


@functools.cache
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_varlen_attn()).parameters)


def _window_kw(causal: bool, window: int | None) -> dict:
    """torch 2.10 spells causality `is_causal`; later releases a `window_size` (left, right):
    a window of w keys back is (w - 1, 0). torch 2.9 has no varlen_attn (`attention_kernel`
    sends nothing to it there)."""
    if "window_size" in _varlen_params():
        left = -1 if window is None else window - 1
        return {"window_size": (left, 0) if causal else (-1, -1)}
    assert window is None, "attention_kernel sends windows to varlen_attn only where it has window_size"
    return {"is_causal": causal}


def _flex(q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, cu: Sequence[int], sinks: Tensor | None) -> Tensor:
    return flex_packed(q, k, v, cu, causal=pattern.causal, softcap=pattern.softcap, window=pattern.window, sinks=sinks)


def default_kernel(device: torch.device):
    """The exact reference on CPU; on CUDA the kernel `attention_kernel` picks per call."""
    return cuda_varlen_attention if device.type == "cuda" else sdpa_attention


def local_attention(q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, sinks: Tensor | None = None) -> Tensor:
    """Single-device default: every row is one whole sample (no packing, no padding)."""
    return default_kernel(q.device)(q, k, v, pattern, None, sinks)
