"""Ring attention: exact attention over a sequence whose blocks live on the r ranks of a ring.

Rank j of a ring holds ring block j of the padded row (the zigzag columns of
`data.ring_order.block_columns`: chunks j and 2r-1-j of 2r) for some heads. Forward: r steps;
at step s the rank attends its queries to the keys / values of block (j - s) mod r, while
sending that block on to rank j + 1 and receiving block (j - s - 1) from rank j - 1
(`comm.RingShift`, point-to-point, overlapped with the step's attention). Each step's
partial output joins the running one through the log-sum-exps: with ``m = logaddexp(a, b)``,
``o = o_a e^(a-m) + o_b e^(b-m)`` — the softmax over all keys, computed in pieces.

Backward (an autograd Function, so nothing of the r steps but q, k, v, the output and its
log-sum-exp is kept): the blocks go round again; at each step the rank adds the gradient
its queries give the visiting block's keys and values to that block's accumulator (fp32),
which travels one step behind the block and reaches its home rank after r steps, holding
the sum of every rank's contribution: dK and dV are exact. dQ stays on its rank. Blocks
travel in the inputs' dtype (2 x (r - 1) block sends per layer, forward and backward), the
accumulators in fp32 (r sends, the last one not overlapped).

Masks are exact per (query, key) column pair: the same document of ``cu_seqlens`` (padding
attends to nothing and its output is zero), the key not after the query for causal
attention, and fewer than ``window`` columns back for a sliding window. Each block is two
chunks, and a chunk pair with nothing to attend is skipped: under causal attention every
rank computes two of the four chunk pairs per step (three on its own block), so the zigzag
order gives every rank the same work. Grouped-query attention: each key / value head serves
its consecutive query heads, and its gradient is the sum over them. A block every rank holds
itself (the replicated text of joint attention, `runtime.ring_joint`) joins the softmax once,
after the ring's steps, with its own mask.

Refused under ring (a ValueError naming the feature): logit softcapping and attention sinks
(their backward is not written here), bidirectional blocks (Gemma 3's images), and the
factorized spatial / temporal patterns (a frame is not a ring block). The block attention
runs through torch's memory-efficient SDPA on CUDA where the inputs allow
(`runtime.ring_fused`: it returns the log-sum-exp, and its backward takes the merged output
and log-sum-exp), and is written out in fp32 elsewhere: the exact reference, on CPU and for
the inputs the fused kernel does not take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dcparallel.data.ring_order import block_columns
from dcparallel.models.attention import AttnPattern
from dcparallel.runtime.comm import RingShift
from dcparallel.runtime.ring_fused import FusedKernel, fused_attend, fused_grads, fused_kernel


@dataclass(frozen=True)
class RingPeers:
    """This rank's ring: the process group the sends go through, the global ranks of the
    ring in block order (block j lives on ``ranks[j]``), and this rank's block."""

    group: object
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def shift(self, t: Tensor) -> RingShift:
        r, j = self.size, self.index
        return RingShift(t, self.ranks[(j + 1) % r], self.ranks[(j - 1) % r], self.group)


def check_ring_pattern(pattern: AttnPattern, sinks: Tensor | None, ring: int) -> None:
    """Refuses what ring attention does not compute exactly (see the module docstring)."""
    if pattern.kind not in ("causal", "full"):
        raise ValueError(
            f"ring attention (ring degree {ring}) runs causal or full attention; the model's "
            f"{pattern.kind!r} attention factorizes by frames, which ring blocks do not follow; "
            f"plan this model with ring degree 1 (Ulysses)"
        )
    if pattern.softcap is not None:
        raise ValueError(
            f"ring attention (ring degree {ring}) does not implement logit softcapping (softcap="
            f"{pattern.softcap}); plan this model with ring degree 1 (Ulysses)"
        )
    if sinks is not None:
        raise ValueError(
            f"ring attention (ring degree {ring}) does not implement attention sinks; plan this model "
            f"with ring degree 1 (Ulysses)"
        )
    if pattern.blocks:
        raise ValueError(
            f"ring attention (ring degree {ring}) does not implement bidirectional blocks (Gemma 3's "
            f"image tokens attending to each other inside each image, spans {list(pattern.blocks)}); "
            f"plan this model with ring degree 1 (Ulysses)"
        )


def _doc_ids(cu_seqlens: Sequence[int], padded_len: int) -> Tensor:
    """(padded_len,) the document of each column; -1 on padding."""
    out = torch.full((padded_len,), -1, dtype=torch.long)
    for d, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
        out[a:b] = d
    return out


@dataclass(frozen=True)
class _Masks:
    """Which chunk pairs of a (query block, key block) attend, and their masks."""

    docs: Tensor
    padded_len: int
    ring: int
    causal: bool
    window: int | None

    def chunks(self, block: int) -> list[tuple[slice, Tensor]]:
        """The block's two chunks: their slice of the block and their columns."""
        cols = torch.tensor(block_columns(self.padded_len, self.ring, block))
        c = len(cols) // 2
        return [(slice(0, c), cols[:c]), (slice(c, 2 * c), cols[c:])]

    def pairs(self, q_block: int, k_block: int, device) -> list[tuple[slice, slice, Tensor]]:
        """(query chunk slice, key chunk slice, (Lq, Lk) mask) for each pair that attends."""
        out = []
        for qs, qc in self.chunks(q_block):
            for ks, kc in self.chunks(k_block):
                if self.causal and kc[0] > qc[-1]:
                    continue
                dq, dk = self.docs[qc], self.docs[kc]
                mask = (dq[:, None] == dk[None, :]) & (dq[:, None] >= 0)
                if self.causal:
                    back = qc[:, None] - kc[None, :]
                    mask &= back >= 0
                    if self.window is not None:
                        mask &= back < self.window
                if mask.any():
                    out.append((qs, ks, mask.to(device)))
        return out


def _finite(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _expand(kv: Tensor, heads: int) -> Tensor:
    rep = heads // kv.shape[2]
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=2)


def _scores(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    s = torch.einsum("blhd,bmhd->bhlm", q, _expand(k, q.shape[2])) * scale
    return s.masked_fill(~mask, float("-inf"))


def attend_block(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One chunk pair, fp32: output (B, Lq, H, Dv) normalized over these keys, and the
    log-sum-exp (B, H, Lq) of its scores (-inf where a query sees none of them)."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return torch.einsum("bhlm,bmhd->blhd", p, _expand(v, q.shape[2])), lse


def merge_lse(out: Tensor, lse: Tensor, o: Tensor, lse_o: Tensor) -> tuple[Tensor, Tensor]:
    new = torch.logaddexp(lse, lse_o)
    keep = torch.exp(lse - _finite(new)).transpose(1, 2)[..., None]
    add = torch.exp(lse_o - _finite(new)).transpose(1, 2)[..., None]
    return out * keep + o * add, new


def pack(*ts: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def unpack(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    out, pos = [], 0
    for shape in shapes:
        n = shape.numel()
        out.append(flat[pos : pos + n].view(shape))
        pos += n
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_x: Tensor | None,
        v_x: Tensor | None,
        mask_x: Tensor | None,
        peers: RingPeers,
        masks: _Masks,
        scale: float,
    ) -> Tensor:
        b, n, h, _ = q.shape
        out = q.new_zeros(b, n, h, v.shape[-1], dtype=torch.float32)
        lse = q.new_full((b, h, n), float("-inf"), dtype=torch.float32)
        shapes = (k.shape, v.shape)
        kernel = fused_kernel(q, k, v)
        kv = pack(k, v)  # blocks travel in their own dtype; outputs merge in fp32
        for s in range(peers.size):
            src = (peers.index - s) % peers.size
            pending = peers.shift(kv) if s < peers.size - 1 else None
            kk, vv = unpack(kv, shapes)
            for qs, ks, mask in masks.pairs(peers.index, src, q.device):
                o, lse_o = pair_attend(kernel, q[:, qs], kk[:, ks], vv[:, ks], mask, scale)
                out[:, qs], lse[:, :, qs] = merge_lse(out[:, qs], lse[:, :, qs], o, lse_o)
            if pending is not None:
                kv = pending.wait()
        if k_x is not None:  # the local extra block, attended once (see ring_attention)
            out, lse = merge_lse(out, lse, *pair_attend(fused_kernel(q, k_x, v_x), q, k_x, v_x, mask_x, scale))
        ctx.save_for_backward(q, k, v, out, lse, k_x, v_x, mask_x)
        ctx.peers, ctx.masks, ctx.scale, ctx.kernel = peers, masks, scale, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse, k_x, v_x, mask_x = ctx.saved_tensors
        peers, masks, scale, kernel = ctx.peers, ctx.masks, ctx.scale, ctx.kernel
        do = dout.float()
        delta = (do * out).sum(-1).transpose(1, 2)  # (B, H, L): the softmax backward's row term
        dq = torch.zeros_like(q, dtype=torch.float32)
        shapes = (k.shape, v.shape)
        kv, incoming = pack(k, v), None
        for s in range(peers.size):
            src = (peers.index - s) % peers.size
            pending = peers.shift(kv) if s < peers.size - 1 else None
            kk, vv = unpack(kv, shapes)
            dk, dv = torch.zeros_like(kk, dtype=torch.float32), torch.zeros_like(vv, dtype=torch.float32)
            for qs, ks, mask in masks.pairs(peers.index, src, q.device):
                pair_grads(
                    kernel,
                    q[:, qs],
                    kk[:, ks],
                    vv[:, ks],
                    do[:, qs],
                    out[:, qs],
                    lse[:, :, qs],
                    delta[:, :, qs],
                    mask,
                    scale,
                    dq[:, qs],
                    dk[:, ks],
                    dv[:, ks],
                )
            acc = pack(dk, dv)
            if incoming is not None:  # block src's accumulator, from the ranks it visited before
                acc += incoming.wait()
            incoming = peers.shift(acc)
            if pending is not None:
                kv = pending.wait()
        dk, dv = unpack(incoming.wait(), shapes)  # this rank's own block, every rank's share summed (fp32)
        dk_x = dv_x = None
        if k_x is not None:  # this rank's queries' share of the extra block's gradients
            dk_x, dv_x = torch.zeros_like(k_x, dtype=torch.float32), torch.zeros_like(v_x, dtype=torch.float32)
            pair_grads(fused_kernel(q, k_x, v_x), q, k_x, v_x, do, out, lse, delta, mask_x, scale, dq, dk_x, dv_x)
            dk_x, dv_x = dk_x.to(k_x.dtype), dv_x.to(v_x.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dk_x, dv_x, None, None, None, None


def pair_attend(
    kernel: FusedKernel | None, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """One chunk pair's output and log-sum-exp (fp32): through the fused ``kernel`` where
    `fused_kernel` chose one, else written out in fp32 (`attend_block`)."""
    if kernel is None:
        return attend_block(q.float(), k.float(), v.float(), mask, scale)
    return fused_attend(kernel, q, k, v, mask, scale)


def pair_grads(kernel: FusedKernel | None, q, k, v, do, out, lse, delta, mask, scale, dq, dk, dv) -> None:
    """Adds one chunk pair's gradients into ``dq``, ``dk``, ``dv`` (fp32 views) under the
    whole softmax (``out``, ``lse`` and its row term ``delta`` over every key): through the
    fused ``kernel`` or in fp32 (`block_grads`)."""
    if kernel is None:
        block_grads(q.float(), k.float(), v.float(), do, lse, delta, mask, scale, dq, dk, dv)
        return
    gq, gk, gv = fused_grads(kernel, q, k, v, do, out, lse, mask, scale)
    dq += gq
    dk += gk
    dv += gv


def block_grads(q, k, v, do, lse, delta, mask, scale, dq, dk, dv) -> None:
    """Adds one chunk pair's gradients into the views ``dq``, ``dk``, ``dv`` (fp32), with
    the probabilities of the whole softmax (``lse`` over every key)."""
    h = q.shape[2]
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse)[..., None])
    ds = p * (torch.einsum("blhd,bmhd->bhlm", do, _expand(v, h)) - delta[..., None])
    dq += torch.einsum("bhlm,bmhd->blhd", ds, _expand(k, h)) * scale
    rep = h // k.shape[2]
    dk_h = torch.einsum("bhlm,blhd->bmhd", ds, q) * scale
    dv_h = torch.einsum("bhlm,blhd->bmhd", p, do)
    dk += dk_h.reshape(*dk_h.shape[:2], k.shape[2], rep, -1).sum(3)
    dv += dv_h.reshape(*dv_h.shape[:2], v.shape[2], rep, -1).sum(3)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttnPattern,
    peers: RingPeers,
    cu_seqlens: Sequence[int] | None,
    padded_len: int,
    sinks: Tensor | None = None,
    extra: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """q (B, Lb, H, D), k (B, Lb, H_kv, D), v (B, Lb, H_kv, Dv): ring block ``peers.index``
    of rows of ``padded_len`` columns (Lb = padded_len / ring) -> output (B, Lb, H, Dv).
    ``cu_seqlens``: document boundaries in the whole unpadded row (None: one document
    filling the row). ``extra``: keys (B, X, H_kv, D), values (B, X, H_kv, Dv) and a mask
    broadcasting to (B, 1, Lb, X) (True: the query attends the key) of a block every rank
    holds itself (the replicated text of joint attention, `runtime.ring_joint`): joined to
    the softmax once, after the ring's steps; its key / value gradients are this rank's
    queries' share."""
    r = peers.size
    check_ring_pattern(pattern, sinks, r)
    if q.shape[1] * r != padded_len or k.shape[1] != q.shape[1] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"ring block of query {tuple(q.shape)} and key {tuple(k.shape)} for rows of {padded_len} "
            f"columns over a ring of {r}: each rank holds padded_len / ring columns of every tensor, "
            f"and key heads divide query heads"
        )
    cu = (0, padded_len) if cu_seqlens is None else tuple(cu_seqlens)
    masks = _Masks(_doc_ids(cu, padded_len), padded_len, r, pattern.causal, pattern.window)
    k_x, v_x, mask_x = (None, None, None) if extra is None else extra
    return _RingAttention.apply(q, k, v, k_x, v_x, mask_x, peers, masks, q.shape[-1] ** -0.5)
