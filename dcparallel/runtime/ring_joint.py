"""Joint attention under ring: video tokens split into ring blocks, text tokens on every rank.

Joint attention (HunyuanVideo, CogVideoX, Mochi; Flux, Flux 2 and Qwen-Image over image
tokens the same way) attends over [video tokens, text tokens] in one softmax; inside an SP
micro-batch the video tokens are sharded and the text (a few hundred tokens) is replicated
on every rank of the group. Under ring degree r each rank
holds ring block j of the video rows (after its Ulysses all-to-all: its heads), and the
same text for the same heads as the other ranks of its ring. Exactness needs every key
counted once in every query's softmax:

* video queries: the ring (`runtime.ring`) visits every video block; the text keys and
  values are one more block, local on every rank, joined to the log-sum-exp merge once
  (``extra`` of `ring_attention`). Its key / value gradients are this rank's queries'
  share; the ring's shares add up to the whole gradient.
* text queries: rank j attends them to its own video block, and the ring's first rank
  also to the text, so each key is attended by exactly one rank of the ring; the r partial
  outputs and log-sum-exps go round the ring (point-to-point, r - 1 steps) and every rank
  merges them in block order into the same whole output. Backward: the output gradient is
  a share on every rank (each rank's text stream continues with the whole output), so the
  shares go round the ring and are summed in block order; rank j then differentiates its
  own keys with the whole softmax (the merged log-sum-exp and output): dq of the text is
  a share (the group's shares sum to it), dk and dv of block j are exact and stay on rank
  j, the text's dk and dv come from the first rank only.

Padding of the video rows is neither attended nor attends (its output is zero); the text
mask (False: a padded caption token) masks text keys only, as the models do. Each block pair
runs through the ring's block attention (`ring.pair_attend`: fused on CUDA, fp32 elsewhere).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dcparallel.data.ring_order import block_columns
from dcparallel.models.attention import AttnPattern
from dcparallel.runtime.ring import RingPeers, merge_lse, pack, pair_attend, pair_grads, ring_attention, unpack
from dcparallel.runtime.ring_fused import fused_kernel

FULL = AttnPattern("full")


def _ring_gather(t: Tensor, peers: RingPeers) -> list[Tensor]:
    """Every ring rank's ``t`` (the same shape on each), in block order, by r - 1 shifts."""
    parts: list[Tensor] = [t] * peers.size
    for s in range(1, peers.size):
        t = peers.shift(t).wait()
        parts[(peers.index - s) % peers.size] = t
    return parts


class _TextQueries(torch.autograd.Function):
    """The text queries' attention over every video block and the text (module docstring)."""

    @staticmethod
    def forward(
        ctx,
        q_t: Tensor,
        k: Tensor,
        v: Tensor,
        k_t: Tensor,
        v_t: Tensor,
        video_mask: Tensor,
        text_mask: Tensor,
        peers: RingPeers,
        scale: float,
    ) -> Tensor:
        out, lse = pair_attend(fused_kernel(q_t, k, v), q_t, k, v, video_mask, scale)
        if peers.index == 0:
            out, lse = merge_lse(out, lse, *pair_attend(fused_kernel(q_t, k_t, v_t), q_t, k_t, v_t, text_mask, scale))
        shapes = (out.shape, lse.shape)
        parts = [unpack(p, shapes) for p in _ring_gather(pack(out, lse), peers)]
        out, lse = parts[0]
        for o, lse_o in parts[1:]:
            out, lse = merge_lse(out, lse, o, lse_o)
        ctx.save_for_backward(q_t, k, v, k_t, v_t, video_mask, text_mask, out, lse)
        ctx.peers, ctx.scale = peers, scale
        return out.to(q_t.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q_t, k, v, k_t, v_t, video_mask, text_mask, out, lse = ctx.saved_tensors
        peers, scale = ctx.peers, ctx.scale
        shares = _ring_gather(dout.float().contiguous(), peers)
        do = shares[0]
        for share in shares[1:]:
            do = do + share
        delta = (do * out).sum(-1).transpose(1, 2)
        dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q_t, k, v))
        pair_grads(fused_kernel(q_t, k, v), q_t, k, v, do, out, lse, delta, video_mask, scale, dq, dk, dv)
        dk_t = dv_t = None
        if peers.index == 0:
            dk_t, dv_t = torch.zeros_like(k_t, dtype=torch.float32), torch.zeros_like(v_t, dtype=torch.float32)
            pair_grads(
                fused_kernel(q_t, k_t, v_t), q_t, k_t, v_t, do, out, lse, delta, text_mask, scale, dq, dk_t, dv_t
            )
            dk_t, dv_t = dk_t.to(k_t.dtype), dv_t.to(v_t.dtype)
        return dq.to(q_t.dtype), dk.to(k.dtype), dv.to(v.dtype), dk_t, dv_t, None, None, None, None


def ring_joint_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_text: Tensor,
    k_text: Tensor,
    v_text: Tensor,
    text_mask: Tensor | None,
    peers: RingPeers,
    seq_len: int,
    padded_len: int,
) -> tuple[Tensor, Tensor]:
    """q, k, v (B, Lb, H, D): ring block ``peers.index`` of video rows of ``seq_len`` tokens
    padded to ``padded_len`` columns, this rank's H heads; q_text, k_text, v_text (B, T, H, D):
    the text for the same heads, the same on every rank of the ring; ``text_mask`` (B, T)
    bool, True where a text key may be attended (None: all). Returns the block's video
    output (B, Lb, H, D) and the text output (B, T, H, D), whole and the same on every rank
    of the ring."""
    b, t = q_text.shape[:2]
    if k_text.shape[:2] != (b, t) or v_text.shape[:2] != (b, t) or k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"joint ring attention of video q {tuple(q.shape)}, k {tuple(k.shape)} and text q "
            f"{tuple(q_text.shape)}, k {tuple(k_text.shape)}, v {tuple(v_text.shape)}: the text "
            f"tensors need the same batch and token count, the video keys the queries' block"
        )
    cols = torch.tensor(block_columns(padded_len, peers.size, peers.index), device=q.device)
    real = cols < seq_len  # the block's video columns that hold tokens
    tm = (
        torch.ones(b, t, dtype=torch.bool, device=q.device)
        if text_mask is None
        else text_mask.to(device=q.device, dtype=torch.bool)
    )
    to_text = real[None, None, :, None] & tm[:, None, None, :]
    out = ring_attention(q, k, v, FULL, peers, (0, seq_len), padded_len, extra=(k_text, v_text, to_text))
    out_text = _TextQueries.apply(q_text, k, v, k_text, v_text, real, tm[:, None, None, :], peers, q.shape[-1] ** -0.5)
    return out, out_text
