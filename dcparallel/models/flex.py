"""FlexAttention over packed documents, and the boundaries fused kernels read.

`flex_packed` runs what varlen_attn cannot (logit softcapping, attention sinks, sliding
windows on torch releases whose varlen_attn lacks them) as one fused kernel on CUDA: a block
mask keeps each query inside its document (and window), the softcap is a score mod, and the
sinks rescale the output by its log-sum-exp. The per-document SDPA / eager path in
`dcparallel.models.attention` is its exact reference (FlexAttention has no CPU backward).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


class CuSeqlens(tuple):
    """Document boundaries (a tuple of ints) that may carry the same boundaries as an int32
    tensor on the compute device (``tensor``), shipped with the batch: fused kernels read it
    instead of copying the tuple to the device."""

    tensor: Tensor | None

    def __new__(cls, bounds: Sequence[int], tensor: Tensor | None = None) -> CuSeqlens:
        self = super().__new__(cls, bounds)
        self.tensor = tensor
        return self


def device_cu(cu: Sequence[int], device: torch.device) -> Tensor:
    """The int32 boundaries on ``device``: the batch's own tensor when it is there already."""
    t = getattr(cu, "tensor", None)
    if t is not None and t.device == device and t.numel() == len(cu):
        return t
    return _cu_tensor(tuple(cu), device)


@functools.lru_cache(maxsize=8)
def _cu_tensor(cu: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor(cu, dtype=torch.int32, device=device)


def pad_head(v: Tensor, d: int) -> Tensor:
    """Values with a head size below ``d`` zero-padded to it (fused kernels want one head
    size); the output's padded columns are zero and sliced off, so nothing else changes."""
    return v if v.shape[-1] == d else F.pad(v, (0, d - v.shape[-1]))


def flex_packed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu: Sequence[int],
    *,
    causal: bool,
    softcap: float | None,
    window: int | None,
    sinks: Tensor | None,
) -> Tensor:
    """FlexAttention over packed rows: (B, L, H, D), k (B, L, H_kv, D), v (B, L, H_kv, Dv)
    -> (B, L, H, Dv), padding zero; ``softcap``, ``window`` and ``sinks`` as
    `dcparallel.models.attention.AttnPattern` and its kernels define them. Sinks
    join each softmax's denominator exactly: with lse the row's log-sum-exp, the output
    scales by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); FlexAttention's
    backward takes lse's gradient, so the gradients are exact too."""
    from torch.nn.attention.flex_attention import flex_attention

    n, length, h, d = q.shape
    dv = v.shape[-1]
    mask = _document_mask(CuSeqlens(cu, getattr(cu, "tensor", None)), length, causal, window, q.device)
    fn = _compiled_flex() if q.is_cuda else flex_attention
    out, lse = fn(
        q.transpose(1, 2),
        k.transpose(1, 2),
        pad_head(v, d).transpose(1, 2),
        score_mod=_softcap_mod(softcap),
        block_mask=mask,
        enable_gqa=k.shape[2] != h,
        **_lse_kw(),
    )
    if not isinstance(lse, Tensor):  # return_aux gives an AuxOutput
        lse = lse.lse
    out = out[..., :dv]
    return (out if sinks is None else sink_rescale(out, lse, sinks)).transpose(1, 2)


def sink_rescale(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention without sinks -> with them: ``out`` (B, H, L, Dv) and its softmax's
    log-sum-exp ``lse`` (B, H, L), one sink logit per head ``sinks`` (H,). Each probability
    e^s / Z becomes e^s / (Z + e^sink), i.e. the output times sigmoid(lse - sink); a row that
    sees nothing (lse -inf) stays zero. Differentiable in all three inputs."""
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


@functools.cache
def _lse_kw() -> dict:
    """The log-sum-exp request: ``return_aux`` where torch has it (``return_lse`` is deprecated)."""
    from torch.nn.attention import flex_attention as flex

    if hasattr(flex, "AuxRequest"):
        return {"return_aux": flex.AuxRequest(lse=True)}
    return {"return_lse": True}


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)  # lengths change every micro-batch


@functools.cache
def _softcap_mod(cap: float | None):
    if cap is None:
        return None

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap


@functools.lru_cache(maxsize=4)
def _document_mask(cu: CuSeqlens, length: int, causal: bool, window: int | None, device: torch.device):
    """The block mask of a packed row (every layer of a micro-batch shares it): a query sees
    keys of its own document (at or before it if causal, fewer than ``window`` back), and
    padding (at or after ``cu[-1]``) sees nothing and is seen by nothing. Document ids come
    from the boundaries on the device: nothing is read back to the host."""
    from torch.nn.attention.flex_attention import create_block_mask

    num_docs = len(cu) - 1
    doc = torch.searchsorted(
        device_cu(cu, device)[1:], torch.arange(length, device=device, dtype=torch.int32), right=True
    )

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] < num_docs)
        if causal:
            seen = seen & (kv_idx <= q_idx)
        if window is not None:
            seen = seen & (q_idx - kv_idx < window)
        return seen

    return create_block_mask(mask_mod, None, None, length, length, device=device, _compile=device.type == "cuda")
