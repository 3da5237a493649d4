"""The vision tower inside an SP group: each rank encodes the images and videos dealt to it
(`data.vision_collate.deal_by_patches`, each item whole on one rank), the group exchanges the
embeddings, and each rank places those of the placeholder tokens its sequence shard holds.

Exchange: every rank pads its items' embeddings to the group's largest share and all-gathers
them (`comm.gather_seq`); the gather's backward sums the gradient over the group and hands
each rank the rows of its own items, so an item's embeddings get the gradient of every shard
that holds one of its tokens, once: the single-process gradient. The backward is a collective,
so every rank of the group must reach it in every micro-batch that has vision items: the
gathered rows always enter this rank's input embeddings (`place` indexes them, the caller
selects with its mask), even when its shard holds none of their tokens (a rank with no item
sends an empty share that still asks for a gradient). A family whose tower also feeds later
decoder layers (Qwen3-VL's DeepStack features) joins those features to the embeddings along
the feature dim, so one exchange carries all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dcparallel.data.batch import Batch
from dcparallel.runtime import comm

#: (patches of this rank's items, their grids (m, 3)) -> embeddings (their tokens, D), items in order
Encode = Callable[[Tensor, Tensor], Tensor]


def group_embeddings(
    batch: Batch, group: Any, encode: Encode, tokens: list[int], width: int, dtype: torch.dtype, trainable: bool
) -> Tensor:
    """Every vision item's embeddings (``tokens[i]`` rows of ``width`` for item i), items in
    order, on every rank of the group; this rank encodes only its own items (``vision_owner``)."""
    ex = batch.extras
    owner = ex["vision_owner"].tolist()
    me = batch.rank_in_group
    mine = [i for i, o in enumerate(owner) if o == me]
    if mine:
        out = encode(ex["pixels"], ex["vision_grid"][mine])
        if out.shape[0] != sum(tokens[i] for i in mine):
            raise ValueError(
                f"the vision tower returned {out.shape[0]} embeddings for items {mine} of grids "
                f"{ex['vision_grid'][mine].tolist()}, expected {sum(tokens[i] for i in mine)}"
            )
    else:
        out = torch.zeros(0, width, dtype=dtype, device=batch.inputs.device, requires_grad=trainable)
    if batch.sp == 1:
        return out
    share = [sum(t for t, o in zip(tokens, owner, strict=True) if o == r) for r in range(batch.sp)]
    rows = max(share)
    gathered = comm.gather_seq(F.pad(out, (0, 0, 0, rows - out.shape[0])), group, dim=0)
    index, filled = [], [0] * batch.sp
    for t, o in zip(tokens, owner, strict=True):
        index += range(o * rows + filled[o], o * rows + filled[o] + t)
        filled[o] += t
    return gathered[torch.tensor(index, dtype=torch.long, device=gathered.device)]


def check_placeholders(batch: Batch, tokens: list[int], token_ids: dict[int, int]) -> None:
    """Each document's placeholder tokens of each vision kind number exactly the tokens of its
    items of that kind (``tokens``: per item): otherwise an image would be dropped, or a
    placeholder trained as text."""
    ex = batch.extras
    row = ex["row_ids"][0]
    kinds, docs = ex["vision_kind"].tolist(), ex["vision_doc"].tolist()
    for d, (a, b) in enumerate(zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True)):
        for k, tok in token_ids.items():
            found = int((row[a:b] == tok).sum())
            given = sum(t for t, kk, dd in zip(tokens, kinds, docs, strict=True) if kk == k and dd == d)
            if found != given:
                raise ValueError(
                    f"sample {batch.sample_ids[d]} has {found} placeholder tokens {tok} but its "
                    f"{'images' if k == 1 else 'videos'} give {given} embeddings; pass each sample's "
                    f"processor output whole (input_ids with the pixel values and grids it made)"
                )


def place(batch: Batch, whole: Tensor, tokens: list[int], token_ids: dict[int, int]) -> tuple[Tensor, Tensor]:
    """(rows (shard_len, W), mask (shard_len,) bool): at each placeholder token of the shard, of
    vision kind k (``token_ids[k]``), its row of ``whole`` (every item's embeddings, items in
    order; the j-th placeholder of kind k in the whole row takes the j-th row of kind k's
    items); zeros and False elsewhere."""
    ex = batch.extras
    row = ex["row_ids"][0].to(whole.device)
    kinds = ex["vision_kind"].tolist()
    lo, n = batch.shard_start, batch.shard_len
    hi = min(lo + n, batch.seq_len)
    placed = whole.new_zeros(n, whole.shape[1])
    mask = torch.zeros(n, dtype=torch.bool, device=whole.device)
    starts = [sum(tokens[:i]) for i in range(len(tokens))]
    for k, tok in token_ids.items():
        rows = [torch.arange(s, s + t) for s, t, kk in zip(starts, tokens, kinds, strict=True) if kk == k]
        rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        is_tok = row == tok
        before = int(is_tok[:lo].sum()) if lo < batch.seq_len else rows.numel()
        local = is_tok[lo:hi].nonzero()[:, 0] if hi > lo else torch.zeros(0, dtype=torch.long, device=whole.device)
        take = rows[before : before + local.numel()].to(whole.device)
        placed = placed.index_put((local,), whole[take])
        mask[local] = True
    return placed, mask
