"""Collation: whole samples of a `MicroBatch` -> this rank's `Batch` (text packing, video stacking).

Text documents pack into one row (`cu_seqlens`, per-document positions); labels are shifted
on the whole document before sharding, so no shard boundary loses a target. Same-shape video
samples stack as rows. Pure tensor code, used by the loader's workers and the profiler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dcparallel.data.batch import Batch
from dcparallel.data.ring_order import ring_padded_length, shard_columns
from dcparallel.loss import IGNORE_INDEX, shift_labels
from dcparallel.plan.types import MicroBatch

__all__ = [
    "IGNORE_INDEX",
    "CollateFn",
    "collate_text",
    "collate_video",
    "padded_length",
    "resolve_collate",
    "text_batch",
    "video_batch",
]

#: a custom collate: (loaded samples by id, the micro-batch, its group's ranks, this rank)
#: -> whatever the training loop wants for that micro-batch (usually a `Batch`)
CollateFn = Callable[[Mapping[int, Any], MicroBatch, tuple[int, ...], int], Any]


def _group_slot(ranks: Sequence[int], rank: int, mb: MicroBatch) -> int:
    ranks = tuple(ranks)
    if mb.layout.sp != len(ranks):
        raise ValueError(f"micro-batch layout sp={mb.layout.sp} but its group has {len(ranks)} ranks {ranks}")
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the group {ranks} that runs samples {mb.sample_ids}")
    return ranks.index(rank)


def _pad_shard(x: Tensor, padded_len: int, sp: int, slot: int, fill, ring: int = 1) -> Tensor:
    """(B, L, ...) padded to (B, padded_len, ...) with ``fill`` -> columns of shard ``slot``
    (only the shard is copied, and padded where it runs past L). Under ring attention
    (``ring`` > 1) the shard is the slot's zigzag columns (`data.ring_order`)."""
    b, n = x.shape[:2]
    if ring > 1:
        cols = torch.tensor(shard_columns(padded_len, sp, ring, slot))
        out = x.new_full((b, len(cols), *x.shape[2:]), fill)
        real = cols < n
        out[:, real] = x[:, cols[real]]
        return out
    ls = padded_len // sp
    lo = slot * ls
    out = x.new_full((b, ls, *x.shape[2:]), fill)
    real = max(0, min(ls, n - lo))
    out[:, :real] = x[:, lo : lo + real]
    return out


def padded_length(seq_len: int, sp: int, ring: int = 1) -> int:
    return ring_padded_length(seq_len, sp, ring)


def text_batch(
    mb: MicroBatch,
    ranks: Sequence[int],
    rank: int,
    docs: Mapping[int, Tensor],
    labels: Mapping[int, Tensor] | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Batch:
    """Packs the micro-batch's documents (1-D token ids) into one row, in plan order.

    ``labels`` (already aligned next-token targets per document) default to the documents
    shifted by one with the last token ignored."""
    slot = _group_slot(ranks, rank, mb)
    sp = mb.layout.sp
    toks, labs, pos, owner, cu, targets = [], [], [], [], [0], []
    for i, sid in enumerate(mb.sample_ids):
        d = docs[sid].reshape(-1).long()
        if d.numel() < 1:
            raise ValueError(f"sample {sid} has no tokens")
        if labels is None:
            lab = shift_labels(d, ignore_index)
        else:
            lab = labels[sid].reshape(-1).long()
            if lab.shape != d.shape:
                raise ValueError(f"sample {sid}: labels {tuple(lab.shape)} and tokens {tuple(d.shape)} differ")
        toks.append(d)
        labs.append(lab)
        pos.append(torch.arange(d.numel()))
        owner.append(torch.full_like(d, i))
        cu.append(cu[-1] + d.numel())
        targets.append(int((lab != ignore_index).sum()))
    seq_len = cu[-1]
    ring = mb.layout.ring
    plen = padded_length(seq_len, sp, ring)
    lab_row = torch.cat(labs)[None]
    labels_shard = _pad_shard(lab_row, plen, sp, slot, ignore_index, ring)
    return Batch(
        sample_ids=tuple(mb.sample_ids),
        layout=mb.layout,
        ranks=tuple(ranks),
        rank_in_group=slot,
        inputs=_pad_shard(torch.cat(toks)[None], plen, sp, slot, 0, ring),
        positions=_pad_shard(torch.cat(pos)[None], plen, sp, slot, 0, ring),
        labels=labels_shard,
        loss_mask=labels_shard != ignore_index,
        token_sample=_pad_shard(torch.cat(owner)[None], plen, sp, slot, -1, ring),
        num_targets=tuple(targets),
        cu_seqlens=tuple(cu),
        seq_len=seq_len,
        padded_len=plen,
    )


def video_batch(
    mb: MicroBatch,
    ranks: Sequence[int],
    rank: int,
    tokens: Mapping[int, Tensor],
    positions: Mapping[int, Tensor],
    frames: int,
) -> Batch:
    """Stacks same-shape video samples (patch tokens (N, C), positions (N, 3)) as rows."""
    slot = _group_slot(ranks, rank, mb)
    sp = mb.layout.sp
    x = [tokens[s] for s in mb.sample_ids]
    n = x[0].shape[0]
    pos0 = positions[mb.sample_ids[0]]
    if any(t.shape != x[0].shape or not torch.equal(positions[s], pos0) for s, t in zip(mb.sample_ids, x, strict=True)):
        raise ValueError(
            f"samples {mb.sample_ids} of one video micro-batch must share a shape; got {[tuple(t.shape) for t in x]}"
        )
    if n % frames:
        raise ValueError(f"{n} tokens per sample do not split into {frames} frames")
    ring = mb.layout.ring
    plen = padded_length(n, sp, ring)
    b = len(x)
    real = torch.ones(b, n, dtype=torch.bool)
    owner = torch.arange(b)[:, None].expand(b, n)
    return Batch(
        sample_ids=tuple(mb.sample_ids),
        layout=mb.layout,
        ranks=tuple(ranks),
        rank_in_group=slot,
        inputs=_pad_shard(torch.stack(x), plen, sp, slot, 0.0, ring),
        positions=_pad_shard(torch.stack([positions[s] for s in mb.sample_ids]), plen, sp, slot, 0, ring),
        labels=None,
        loss_mask=_pad_shard(real, plen, sp, slot, False, ring),
        token_sample=_pad_shard(owner, plen, sp, slot, -1, ring),
        num_targets=(n,) * b,
        cu_seqlens=(0, n),
        seq_len=n,
        padded_len=plen,
        frames=frames,
    )


def collate_text(
    samples: Mapping[int, Any], mb: MicroBatch, ranks: tuple[int, ...], rank: int, ignore_index: int = IGNORE_INDEX
) -> Batch:
    """Packs the micro-batch's documents into one row (`cu_seqlens`, per-document positions;
    labels shifted per document before sharding) and returns this rank's shard.

    A sample is a 1-D tensor of token ids, or a mapping with ``input_ids`` and optionally
    ``labels`` (next-token targets aligned with the inputs, ``ignore_index`` where none)."""
    docs, labels = {}, {}
    for sid in mb.sample_ids:
        s = samples[sid]
        if isinstance(s, Mapping):
            if "input_ids" not in s:
                raise ValueError(
                    f"sample {sid} is a mapping without 'input_ids' (keys {sorted(s)}); "
                    f"return the token ids as 'input_ids' or as a 1-D tensor"
                )
            docs[sid] = torch.as_tensor(s["input_ids"])
            if s.get("labels") is not None:
                labels[sid] = torch.as_tensor(s["labels"])
        else:
            docs[sid] = torch.as_tensor(s)
    if labels and len(labels) != len(docs):
        raise ValueError(f"some samples of {mb.sample_ids} have labels and some do not; give labels for all or none")
    return text_batch(mb, ranks, rank, docs, labels or None, ignore_index)


def collate_video(samples: Mapping[int, Any], mb: MicroBatch, ranks: tuple[int, ...], rank: int) -> Batch:
    """Stacks same-shape video samples as rows and returns this rank's shard. A sample is a
    mapping with ``tokens`` (N, C) patch tokens, ``positions`` (N, 3) and ``frames``
    (latent frames; N = frames x spatial tokens), e.g. from `dcparallel.models.dit.patchify`."""
    for sid in mb.sample_ids:
        s = samples[sid]
        if not isinstance(s, Mapping) or not {"tokens", "positions", "frames"} <= set(s):
            raise ValueError(
                f"video sample {sid} must be a mapping with 'tokens', 'positions' and 'frames'; got {type(s).__name__}"
            )
    frames = {int(samples[s]["frames"]) for s in mb.sample_ids}
    if len(frames) != 1:
        raise ValueError(f"samples {mb.sample_ids} of one micro-batch have different frame counts {sorted(frames)}")
    return video_batch(
        mb,
        ranks,
        rank,
        {s: samples[s]["tokens"] for s in mb.sample_ids},
        {s: samples[s]["positions"] for s in mb.sample_ids},
        frames.pop(),
    )


def resolve_collate(collate: str | CollateFn | None, kind: str, ignore_index: int = IGNORE_INDEX) -> CollateFn | None:
    """The collate function of a ``collate`` setting: "auto" (text or video by the model's
    kind), "text", "video", a function, or None (the raw samples)."""
    if collate == "auto":
        collate = "video" if kind == "video" else "text"
    if collate == "text":
        return functools.partial(collate_text, ignore_index=ignore_index)
    if collate == "video":
        return collate_video
    if collate is None or callable(collate):
        return collate
    raise ValueError(f"collate must be 'auto', 'text', 'video', a function or None; got {collate!r}")
