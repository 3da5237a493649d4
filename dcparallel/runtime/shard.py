"""Builds one rank's `Batch` from whole per-sample tensors and a `MicroBatch`.

Used by the tests now and by the loader later. Labels are shifted on the whole document
before sharding, so no shard boundary loses a target."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from dcparallel.data.batch import Batch
from dcparallel.models.llama import IGNORE_INDEX, shift_labels
from dcparallel.plan.types import MicroBatch


def _group_slot(ranks: Sequence[int], rank: int, mb: MicroBatch) -> int:
    ranks = tuple(ranks)
    if mb.layout.sp != len(ranks):
        raise ValueError(f"micro-batch layout sp={mb.layout.sp} but its group has {len(ranks)} ranks {ranks}")
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in the group {ranks} that runs samples {mb.sample_ids}")
    return ranks.index(rank)


def _pad_shard(x: Tensor, padded_len: int, sp: int, slot: int, fill) -> Tensor:
    """(B, L, ...) padded to (B, padded_len, ...) with ``fill`` -> columns of shard ``slot``
    (only the shard is copied, and padded where it runs past L)."""
    b, n = x.shape[:2]
    ls = padded_len // sp
    lo = slot * ls
    out = x.new_full((b, ls, *x.shape[2:]), fill)
    real = max(0, min(ls, n - lo))
    out[:, :real] = x[:, lo : lo + real]
    return out


def padded_length(seq_len: int, sp: int) -> int:
    return -(-seq_len // sp) * sp


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
                raise ValueError(
                    f"sample {sid}: labels {tuple(lab.shape)} and tokens {tuple(d.shape)} differ"
                )
        toks.append(d)
        labs.append(lab)
        pos.append(torch.arange(d.numel()))
        owner.append(torch.full_like(d, i))
        cu.append(cu[-1] + d.numel())
        targets.append(int((lab != ignore_index).sum()))
    seq_len = cu[-1]
    plen = padded_length(seq_len, sp)
    lab_row = torch.cat(labs)[None]
    labels_shard = _pad_shard(lab_row, plen, sp, slot, ignore_index)
    return Batch(
        sample_ids=tuple(mb.sample_ids),
        layout=mb.layout,
        ranks=tuple(ranks),
        rank_in_group=slot,
        inputs=_pad_shard(torch.cat(toks)[None], plen, sp, slot, 0),
        positions=_pad_shard(torch.cat(pos)[None], plen, sp, slot, 0),
        labels=labels_shard,
        loss_mask=labels_shard != ignore_index,
        token_sample=_pad_shard(torch.cat(owner)[None], plen, sp, slot, -1),
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
    if any(
        t.shape != x[0].shape or not torch.equal(positions[s], pos0)
        for s, t in zip(mb.sample_ids, x, strict=True)
    ):
        raise ValueError(
            f"samples {mb.sample_ids} of one video micro-batch must share a shape; got "
            f"{[tuple(t.shape) for t in x]}"
        )
    if n % frames:
        raise ValueError(f"{n} tokens per sample do not split into {frames} frames")
    plen = padded_length(n, sp)
    b = len(x)
    real = torch.ones(b, n, dtype=torch.bool)
    owner = torch.arange(b)[:, None].expand(b, n)
    return Batch(
        sample_ids=tuple(mb.sample_ids),
        layout=mb.layout,
        ranks=tuple(ranks),
        rank_in_group=slot,
        inputs=_pad_shard(torch.stack(x), plen, sp, slot, 0.0),
        positions=_pad_shard(torch.stack([positions[s] for s in mb.sample_ids]), plen, sp, slot, 0),
        labels=None,
        loss_mask=_pad_shard(real, plen, sp, slot, False),
        token_sample=_pad_shard(owner, plen, sp, slot, -1),
        num_targets=(n,) * b,
        cu_seqlens=(0, n),
        seq_len=n,
        padded_len=plen,
        frames=frames,
    )
