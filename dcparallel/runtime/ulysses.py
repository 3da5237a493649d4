"""Ulysses attention: sequence-sharded in, sequence-sharded out.

Each rank of an SP group of size sp holds L/sp consecutive tokens of every row (L padded to
a multiple of sp) with all H heads. One all-to-all of the stacked q, k, v gives every rank
the whole sequence for H/sp heads; the kernel runs attention there (documents of
``cu_seqlens`` apart, padding neither attending nor attended, its output zero); a second
all-to-all returns the output to sequence sharding. Backward mirrors both all-to-alls.
Rotary embeddings are applied by the model before the call, with the shard's global
positions, so nothing about positions happens here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dcparallel.models.attention import AttnPattern, default_kernel
from dcparallel.runtime.comm import group_size, heads_to_seq, seq_to_heads

Kernel = Callable[[Tensor, Tensor, Tensor, AttnPattern, "Sequence[int] | None"], Tensor]


def check_heads(num_heads: int, sp: int) -> None:
    if sp < 1 or num_heads % sp:
        raise ValueError(
            f"Ulysses shards the {num_heads} attention heads over the SP group of {sp} ranks: "
            f"{num_heads} is not divisible by {sp}; use an SP degree that divides the heads "
            f"(dcparallel.spec.group_sizes lists them)"
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
) -> Tensor:
    """q, k, v (B, L/sp, H, D): this rank's shard of the padded rows -> output (B, L/sp, H, D).

    ``cu_seqlens`` are document boundaries in the whole unpadded row (global positions);
    None = one document filling the whole padded row."""
    sp = group_size(group)
    check_heads(q.shape[2], sp)
    kernel = kernel or default_kernel(q.device)
    if sp == 1:
        return kernel(q, k, v, pattern, cu_seqlens)
    full = seq_to_heads(torch.stack([q, k, v]), group)
    out = kernel(full[0], full[1], full[2], pattern, cu_seqlens)
    return heads_to_seq(out, group)


@dataclass
class _Active:
    group: object
    cu_seqlens: tuple[int, ...] | None


class UlyssesAttention:
    """The attention function the engine installs into a model (`model.set_attention`).

    Outside a micro-batch it behaves like the model's local attention (one sample per row);
    inside, `activate` gives it the micro-batch's SP group and document boundaries."""

    def __init__(self, kernel: Kernel | None = None):
        self.kernel = kernel
        self._active: _Active | None = None

    def activate(self, group, cu_seqlens: Sequence[int] | None) -> None:
        self._active = _Active(group, None if cu_seqlens is None else tuple(cu_seqlens))

    def deactivate(self) -> None:
        self._active = None

    def state(self) -> _Active | None:
        return self._active

    @contextlib.contextmanager
    def restored(self, state: _Active | None) -> Iterator[None]:
        """Runs a block (a recomputed forward) with the state a forward saw."""
        prev, self._active = self._active, state
        try:
            yield
        finally:
            self._active = prev

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, pattern: AttnPattern) -> Tensor:
        a = self._active
        if a is None:
            return ulysses_attention(q, k, v, pattern, group=None, kernel=self.kernel)
        return ulysses_attention(q, k, v, pattern, group=a.group, cu_seqlens=a.cu_seqlens, kernel=self.kernel)
