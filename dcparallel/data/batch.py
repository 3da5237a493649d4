"""`Batch`: one rank's share of one `MicroBatch`, as the loader hands it to the loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dcparallel.data.ring_order import shard_columns
from dcparallel.spec import Layout


@dataclass(frozen=True, kw_only=True)
class Batch:
    """This rank's shard of a micro-batch.

    Rows (dim 0) are packed text (one row holding several documents, ``cu_seqlens``) or
    same-shape video samples (one sample per row). Every row has ``seq_len`` real tokens,
    padded to ``padded_len`` (a multiple of the SP degree); this rank holds columns
    ``shard_start : shard_start + padded_len // sp`` of every row (under ring attention the
    zigzag columns `shard_columns`)."""

    sample_ids: tuple[int, ...]
    """the micro-batch's samples, in plan order"""
    layout: Layout
    ranks: tuple[int, ...]
    """the SP group (GroupPlan.ranks) that runs this micro-batch"""
    rank_in_group: int
    inputs: Tensor
    """(B, Ls) token ids, or (B, Ls, C) clean latent tokens"""
    positions: Tensor
    """(B, Ls) position in its document, or (B, Ls, 3) (t, h, w) patch indices; global"""
    labels: Tensor | None
    """(B, Ls) next-token targets, shifted before sharding; ignore_index where no target"""
    loss_mask: Tensor
    """(B, Ls) bool: this shard's targets (never true on padding)"""
    token_sample: Tensor
    """(B, Ls) long: index into sample_ids of each token's sample; -1 on padding"""
    num_targets: tuple[int, ...]
    """targets of each whole sample, counted before sharding"""
    cu_seqlens: tuple[int, ...]
    """document boundaries in the whole unpadded row (the same for every row)"""
    seq_len: int
    padded_len: int
    frames: int = 1
    """video: latent frames per sample (tokens = frames x spatial); 1 for text"""
    sharded: bool = True
    """True: the tensors are this rank's shard of the rows (what the loader's text and token
    collates give); False: every rank of the group holds whole samples (dense video latents)
    and the model adapter shards the token sequence inside the model"""
    extras: Mapping[str, Tensor] = field(default_factory=dict)
    """per-sample conditioning the model takes besides ``inputs`` (e.g. text embeddings
    ``encoder_hidden_states`` of a video model), stacked over the rows, never sharded"""
    step: int | None = None
    """index of the step in its epoch (set by the loader; None for a hand-made batch)"""
    last_of_step: bool | None = None
    """this rank's last micro-batch of the step: its backward overlaps the gradient sync
    (set by the loader; None: unknown, the sync runs whole in `sync_gradients`)"""
    cu_seqlens_tensor: Tensor | None = None
    """``cu_seqlens`` as int32, built where the batch is (the loader's workers) and moved
    with it, so fused attention kernels never copy boundaries to the device mid-step; None
    builds it (pass None with new ``cu_seqlens`` in `dataclasses.replace`)"""
    inverse_targets: Tensor | None = None
    """(samples + 1,) float32: 1 / targets of each whole sample, then 0 (for padding's -1),
    moved with the batch for `sample_mean_weights`; None builds it from ``num_targets``"""
    per_token: Mapping[str, Tensor] = field(default_factory=dict)
    """(B, Ls, ...) per-token tensors of the samples (RL advantages, old and reference
    log-probs: `data.rollouts`), shifted like ``labels`` (position p holds the value of the
    token predicted at p) and sharded like them; 0 on padding"""

    def __post_init__(self) -> None:
        if self.cu_seqlens_tensor is None:
            object.__setattr__(self, "cu_seqlens_tensor", torch.tensor(self.cu_seqlens, dtype=torch.int32))
        if self.inverse_targets is None:
            inv = [1.0 / max(n, 1) for n in self.num_targets] + [0.0]
            object.__setattr__(self, "inverse_targets", torch.tensor(inv, dtype=torch.float32))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None, non_blocking: bool = False) -> Batch:
        """The batch with every tensor on ``device`` (floating ones cast to ``dtype`` if
        given); pinned host tensors copy without blocking when ``non_blocking``."""

        def move(v: Tensor) -> Tensor:
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            return v.to(device, non_blocking=non_blocking)

        changes = {
            f.name: move(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        changes["extras"] = {k: move(v) for k, v in self.extras.items()}
        changes["per_token"] = {k: move(v) for k, v in self.per_token.items()}
        return dataclasses.replace(self, **changes)

    def pin_memory(self) -> Batch:
        """The batch with its host tensors in pinned memory (for non-blocking device copies)."""
        changes = {
            f.name: getattr(self, f.name).pin_memory()
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        changes["extras"] = {k: v.pin_memory() for k, v in self.extras.items()}
        changes["per_token"] = {k: v.pin_memory() for k, v in self.per_token.items()}
        return dataclasses.replace(self, **changes)

    @property
    def sp(self) -> int:
        return len(self.ranks)

    @property
    def shard_len(self) -> int:
        return self.padded_len // self.sp

    @property
    def ring(self) -> int:
        """The ring-attention degree of the layout (1: Ulysses only; `data.ring_order`)."""
        return self.layout.ring

    @property
    def shard_start(self) -> int:
        """The first column of this rank's contiguous shard; under ring attention a shard is
        not contiguous (`shard_columns`)."""
        if self.ring > 1:
            raise ValueError(
                f"this micro-batch runs ring attention (ring degree {self.ring}): its shard is the "
                f"zigzag columns Batch.shard_columns(), not one contiguous range"
            )
        return self.rank_in_group * self.shard_len

    def shard_columns(self) -> list[int]:
        """The columns of the padded row this rank holds, in order (`data.ring_order`)."""
        return shard_columns(self.padded_len, self.sp, self.ring, self.rank_in_group)

    def shard_sample(self, x: Tensor) -> Tensor:
        """A tensor over one whole row's real tokens (seq_len, ...) -> this rank's slice
        (shard_len, ...), zero on padding. For per-sample noise drawn over the whole sample."""
        if x.shape[0] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} tokens along dim 0, got shape {tuple(x.shape)}")
        out = x.new_zeros(self.shard_len, *x.shape[1:])
        if self.ring > 1:
            cols = torch.tensor(self.shard_columns())
            real = cols < self.seq_len
            out[real] = x[cols[real]]
            return out
        lo, hi = self.shard_start, self.shard_start + self.shard_len
        real_hi = min(hi, self.seq_len)
        if real_hi > lo:
            out[: real_hi - lo] = x[lo:real_hi]
        return out

    def sample_mean_weights(self) -> Tensor:
        """Per-token weight 1 / (targets of its whole sample): with these, `token_loss`
        gives the mean over samples instead of the mean over target tokens."""
        inv = self.inverse_targets.to(self.token_sample.device)  # already there when moved with the batch
        return inv[self.token_sample]  # index -1 picks the trailing 0 for padding
