"""Ulysses attention: sequence-sharded in, sequence-sharded out.

Each rank of an SP group of size sp holds L/sp consecutive tokens of every row (L padded to
a multiple of sp) with all H heads. One all-to-all of q, k, v gives every rank the whole
sequence for H/sp heads; the kernel runs attention there (documents of
``cu_seqlens`` apart, padding neither attending nor attended, its output zero); a second
all-to-all returns the output to sequence sharding. Backward mirrors both all-to-alls.
Rotary embeddings are applied by the model before the call, with the shard's global
positions, so nothing about positions happens here.

Values may have a head size unlike queries' and keys' (multi-head latent attention): each
tensor travels with its own head size. Per-head sink logits (``sinks``, one per query head)
are sliced to the rank's query heads after the all-to-all, so each rank's softmax uses its
own heads' sinks; the slice's gradient lands in those entries only, and the gradient sync
sums the entries over ranks (each head's entry comes from the rank that holds the head).
Softcapping and sliding windows travel in the `AttnPattern`.

Grouped-query / multi-query attention (k, v with H_kv < H query heads, H divisible by H_kv):
when sp divides H_kv the key/value heads are sharded like the query heads; otherwise each
key/value head is repeated r = sp / gcd(sp, H_kv) times first (r divides H / H_kv, so rank
p's query heads still find their own key/value heads among its H_kv * r / sp). Either way
the SP degree is limited by the query heads only (`cost.heads.kv_heads_sent` gives the all-to-all's
key/value head count for the cost model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from torch import Tensor

from dcparallel.cost.heads import kv_repeats
from dcparallel.models.attention import AttnPattern, default_kernel
from dcparallel.models.flex import CuSeqlens
from dcparallel.runtime.comm import group_rank, group_size, heads_to_seq, seq_to_heads
from dcparallel.runtime.ring import RingPeers, check_ring_pattern, ring_attention

#: ``kernel(q, k, v, pattern, cu_seqlens)``, and ``sinks=`` (this rank's heads' sink logits)
#: when the model has sinks (`dcparallel.models.attention.sdpa_attention` is one)
Kernel = Callable[..., Tensor]


def check_heads(num_heads: int, sp: int) -> None:
    if sp < 1 or num_heads % sp:
        raise ValueError(
            f"Ulysses shards the {num_heads} attention heads over the SP group of {sp} ranks: "
            f"{num_heads} is not divisible by {sp}; use an SP degree that divides the heads "
            f"(dcparallel.topology.Topology.sizes lists them)"
        )


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttnPattern,
    *,
    group,
    cu_seqlens: Sequence[int] | None = None,
    kernel: Kernel | None = None,
    sinks: Tensor | None = None,
    ring: RingPeers | None = None,
) -> Tensor:
    """q (B, L/sp, H, D), k (B, L/sp, H_kv, D), v (B, L/sp, H_kv, Dv): this rank's shard of
    the padded rows -> output (B, L/sp, H, Dv). ``sinks``: (H,) sink logits or None.

    ``cu_seqlens`` are document boundaries in the whole unpadded row (global positions);
    None = one document filling the whole padded row. ``ring``: this rank's ring when the
    micro-batch runs ring degree r > 1 (``group`` is then its Ulysses sub-group; the shard
    is its zigzag columns, `data.ring_order`): the all-to-all gives the rank its ring block
    for its heads and `runtime.ring` attends over the whole row."""
    sp = group_size(group)
    hq, hkv = q.shape[2], k.shape[2]
    check_heads(hq, sp)
    if ring is not None and ring.size > 1:
        return _ulysses_ring(q, k, v, pattern, group, ring, cu_seqlens, sinks)
    if k.shape[:3] != v.shape[:3] or k.shape[3] != q.shape[3] or hq % hkv:
        raise ValueError(
            f"query {tuple(q.shape)}, key {tuple(k.shape)} and value {tuple(v.shape)} (batch, tokens, "
            f"heads, head size): key and value need the same batch, tokens and heads, a number of "
            f"heads dividing the {hq} query heads, and keys the query head size (values may have "
            f"their own head size)"
        )
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"attention sinks of shape {tuple(sinks.shape)}: one sink logit per query head is ({hq},)")
    kernel = kernel or default_kernel(q.device)
    if (pattern.softcap is not None or sinks is not None) and not getattr(kernel, "supports_softcap_and_sinks", False):
        raise ValueError(
            f"the model needs logit softcapping or attention sinks, which the attention kernel "
            f"{getattr(kernel, '__name__', kernel)!r} does not declare (supports_softcap_and_sinks); "
            f"leave kernel= out for dcparallel's own, or give a kernel implementing AttnPattern.softcap "
            f"and sinks= that attribute"
        )
    if pattern.window is not None and not getattr(kernel, "supports_window", False):
        raise ValueError(
            f"the model needs a sliding attention window of {pattern.window} keys, which the attention "
            f"kernel {getattr(kernel, '__name__', kernel)!r} does not declare (supports_window); leave "
            f"kernel= out for dcparallel's own, or give a kernel implementing AttnPattern.window that "
            f"attribute"
        )
    if pattern.blocks and not getattr(kernel, "supports_blocks", False):
        raise ValueError(
            f"the model needs bidirectional blocks (Gemma 3's image tokens), which the attention kernel "
            f"{getattr(kernel, '__name__', kernel)!r} does not declare (supports_blocks); leave kernel= "
            f"out for dcparallel's own, or give a kernel implementing AttnPattern.blocks that attribute"
        )
    if sp == 1:
        return kernel(q, k, v, pattern, cu_seqlens, **_sinks_kw(sinks))
    r = kv_repeats(hkv, sp)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    q, k, v = seq_to_heads([q, k, v], group)
    if sinks is not None:  # this rank's query heads (see seq_to_heads)
        hs = hq // sp
        sinks = sinks[group_rank(group) * hs : (group_rank(group) + 1) * hs]
    return heads_to_seq(kernel(q, k, v, pattern, cu_seqlens, **_sinks_kw(sinks)), group)


def _ulysses_ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttnPattern,
    group,
    ring: RingPeers,
    cu_seqlens: Sequence[int] | None,
    sinks: Tensor | None,
) -> Tensor:
    """Ulysses over ``group`` around ring attention over ``ring`` (its own block kernel)."""
    check_ring_pattern(pattern, sinks, ring.size)
    sp = group_size(group)
    padded_len = q.shape[1] * sp * ring.size
    if sp == 1:
        return ring_attention(q, k, v, pattern, ring, cu_seqlens, padded_len)
    r = kv_repeats(k.shape[2], sp)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    q, k, v = seq_to_heads([q, k, v], group)
    return heads_to_seq(ring_attention(q, k, v, pattern, ring, cu_seqlens, padded_len), group)


def _sinks_kw(sinks: Tensor | None) -> dict:
    """A kernel without sinks support is still called without the keyword."""
    return {} if sinks is None else {"sinks": sinks}


@dataclass
class _Active:
    group: object
    cu_seqlens: tuple[int, ...] | None
    batch: object = None
    """the micro-batch's `Batch` (its shard geometry, for models that shard inside)"""
    ring: RingPeers | None = None
    """this rank's ring under ring degree > 1 (``group`` is then the Ulysses sub-group)"""

    @property
    def sp(self) -> int:
        """The micro-batch's whole SP degree: Ulysses x ring."""
        return group_size(self.group) * (1 if self.ring is None else self.ring.size)


class UlyssesAttention:
    """The attention function the engine installs into a model (through its adapter).

    Outside a micro-batch it behaves like the model's local attention (one sample per row);
    inside, `activate` gives it the micro-batch's SP group and document boundaries."""

    def __init__(self, kernel: Kernel | None = None):
        self.kernel = kernel
        self._active: _Active | None = None

    def activate(
        self, group, cu_seqlens: Sequence[int] | None, batch: object = None, ring: RingPeers | None = None
    ) -> None:
        """``cu_seqlens`` travel with the batch's int32 copy (``cu_seqlens_tensor``, on the
        device when the batch was moved there) for the fused kernels. ``ring``: this rank's
        ring (``group`` its Ulysses sub-group) when the micro-batch runs ring degree > 1."""
        docs = None if cu_seqlens is None else CuSeqlens(cu_seqlens, getattr(batch, "cu_seqlens_tensor", None))
        self._active = _Active(group, docs, batch, ring)

    def deactivate(self) -> None:
        self._active = None

    def state(self) -> _Active | None:
        return self._active

    def longest_document(self, local_len: int) -> int:
        """Tokens of the longest document the active micro-batch attends over (a row of
        ``local_len`` tokens per rank outside a micro-batch)."""
        a = self._active
        if a is None or a.cu_seqlens is None:
            return local_len * (1 if a is None else a.sp)
        return max(b - x for x, b in zip(a.cu_seqlens[:-1], a.cu_seqlens[1:], strict=True))

    def document_boundaries(self, local_len: int) -> tuple[int, ...]:
        """The active micro-batch's document boundaries in its whole unpadded rows (one
        document of the whole row outside a micro-batch or without boundaries)."""
        a = self._active
        if a is None or a.cu_seqlens is None:
            return 0, local_len * (1 if a is None else a.sp)
        return a.cu_seqlens

    @contextlib.contextmanager
    def restored(self, state: _Active | None) -> Iterator[None]:
        """Runs a block (a recomputed forward) with the state a forward saw."""
        prev, self._active = self._active, state
        try:
            yield
        finally:
            self._active = prev

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern, sinks: Tensor | None = None) -> Tensor:
        a = self._active
        if a is None:
            return ulysses_attention(q, k, v, pattern, group=None, kernel=self.kernel, sinks=sinks)
        return ulysses_attention(
            q, k, v, pattern, group=a.group, cu_seqlens=a.cu_seqlens, kernel=self.kernel, sinks=sinks, ring=a.ring
        )
