"""Collation of vision-language samples: the text packed and sharded as any text (`collate_text`),
the images and videos listed whole for the vision tower.

A sample is what a transformers processor returns for one chat, without the batch dim:
``input_ids`` (L,), optionally ``labels`` (L,: next-token targets aligned with the inputs,
``ignore_index`` where the chat template marks no training), ``pixel_values`` (patches, C) with
``image_grid_thw`` (images, 3), ``pixel_values_videos`` with ``video_grid_thw`` (videos, 3) and
``second_per_grid_ts`` (videos,); or, for a model whose images are fixed-size tiles (InternVL),
``pixel_values`` (tiles, C, H, W) alone, each tile an item of grid (1, H, W), and (Idefics3,
SmolVLM) ``pixel_attention_mask`` (tiles, H, W) with it (either may keep the processor's batch
dim of 1); Gemma 3's fixed-size images are such tiles too (its pan-and-scan crops, a non-zero
``num_crops``, are refused); LLaVA-OneVision's ``pixel_values`` (images, tiles, C, S, S)
with ``image_sizes`` make each image an item (`_anyres`). The placeholder
tokens of each image stay in ``input_ids``.
A 1-D tensor of token ids is a text-only sample.

The micro-batch's images and videos ("vision items", per document its images then its videos,
each kind in its own order: the order of its placeholder tokens in the row) are dealt to the
ranks of its SP group by patch count (`deal_by_patches`); each rank's `Batch` carries the
patches of its own items only, and every rank the grids, owners and the whole row's token ids,
so that positions and placeholder masks are computed on the whole sequence before it is cut
(`adapters.vlm`). The ``extras`` of the batch:

* ``row_ids`` (1, seq_len): the whole packed row's token ids;
* ``vision_grid`` (n, 3) long: each item's (t, h, w) patch grid, in item order;
* ``vision_kind`` (n,) long: 1 image, 2 video; ``vision_doc`` (n,): its document in the row;
* ``vision_owner`` (n,) long: the rank in the group that encodes it;
* ``vision_seconds`` (n,) long: seconds per temporal grid step (videos; 1.0 for images), the
  float64 bits held as int64 so that moving the batch to a low-precision dtype never rounds them;
* ``pixels`` (patches, C): this rank's items' patches, concatenated in item order (a tile:
  one row, `_tiles`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dcparallel.data.batch import Batch
from dcparallel.data.collate import collate_text
from dcparallel.loss import IGNORE_INDEX
from dcparallel.plan.types import MicroBatch

#: per vision kind: the sample's pixel key and grid key
KINDS = {1: ("pixel_values", "image_grid_thw"), 2: ("pixel_values_videos", "video_grid_thw")}


def deal_by_patches(patches: Sequence[int], sp: int) -> list[int]:
    """The rank (0 .. sp-1) that encodes each item: largest first to the least-loaded rank
    (ties: the lower item index, the lower rank), so the group's slowest rank encodes close
    to 1/sp of the patches when no item dominates. Deterministic: every rank deals the same."""
    load = [0] * sp
    owner = [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda j: (-patches[j], j)):
        r = min(range(sp), key=lambda x: (load[x], x))
        owner[i] = r
        load[r] += patches[i]
    return owner


def _tiles(sample: Mapping[str, Any], doc: int) -> list[tuple[int, Tensor, Tensor, float, int]]:
    """Image tiles (``pixel_values`` (tiles, C, H, W), no grid: InternVL, Idefics3, SmolVLM):
    one item each, of grid (1, H, W) and one row of patches (its pixels flattened, then, with a
    ``pixel_attention_mask`` (tiles, H, W), its mask flattened as 0 / 1). A tile whose pixels
    are all zero is the processor's padding, no image: dropped, as Idefics3 and SmolVLM drop it."""
    pix = torch.as_tensor(sample["pixel_values"])
    pix = pix.reshape(-1, *pix.shape[-3:])
    grid = torch.tensor([1, pix.shape[2], pix.shape[3]], dtype=torch.long)
    rows = pix.reshape(pix.shape[0], -1)
    mask = sample.get("pixel_attention_mask")
    if mask is not None:
        rows = torch.cat([rows, torch.as_tensor(mask).reshape(pix.shape[0], -1).to(rows.dtype)], dim=1)
        rows = rows[(pix != 0).flatten(1).any(1)]
    return [(1, grid, r[None], 1.0, doc) for r in rows]


def _anyres(sid: int, sample: Mapping[str, Any], doc: int) -> list[tuple[int, Tensor, Tensor, float, int]]:
    """LLaVA-OneVision: ``pixel_values`` (images, tiles, C, S, S) with ``image_sizes`` (images,
    2); each image an item of grid (tiles carried, H, W), one row per tile. A sample of several
    images (``batch_num_images`` above 1) carries each image's base view only, as the model
    encodes it."""
    if sample.get("pixel_values_videos") is not None:
        raise ValueError(
            f"sample {sid} holds a video (pixel_values_videos) for an any-resolution model "
            f"(LLaVA-OneVision), whose videos dcparallel has not parity-tested; leave videos out"
        )
    pix = torch.as_tensor(sample["pixel_values"])
    pix = pix.reshape(-1, *pix.shape[-4:])
    sizes = torch.as_tensor(sample["image_sizes"]).reshape(-1, 2).long()
    if pix.shape[0] != sizes.shape[0]:
        raise ValueError(
            f"sample {sid}: pixel_values holds {pix.shape[0]} images but image_sizes {sizes.tolist()}; "
            f"pass the processor's outputs for this sample unchanged"
        )
    many = sample.get("batch_num_images")
    if many is not None and int(torch.as_tensor(many).sum()) != pix.shape[0]:
        raise ValueError(f"sample {sid}: batch_num_images {torch.as_tensor(many).tolist()} but {pix.shape[0]} images")
    keep = 1 if many is not None and pix.shape[0] > 1 else pix.shape[1]
    return [(1, torch.tensor([keep, *s.tolist()]), p[:keep].reshape(keep, -1), 1.0, doc) for p, s in zip(pix, sizes)]


def _items(sid: int, sample: Mapping[str, Any], doc: int) -> list[tuple[int, Tensor, Tensor, float, int]]:
    """(kind, grid, patches, seconds, doc) of the sample's images, then its videos."""
    pix = sample.get("pixel_values")
    if pix is not None and sample.get("image_sizes") is not None:
        return _anyres(sid, sample, doc)
    if pix is not None and sample.get("image_grid_thw") is None and torch.as_tensor(pix).dim() in (4, 5):
        return _tiles(sample, doc)
    out = []
    for kind, (pix_key, grid_key) in KINDS.items():
        grid = sample.get(grid_key)
        if grid is None:
            continue
        grid = torch.as_tensor(grid).reshape(-1, 3).long()
        pix = torch.as_tensor(sample[pix_key])
        counts = grid.prod(-1).tolist()
        if pix.shape[0] != sum(counts):
            raise ValueError(
                f"sample {sid}: {pix_key} has {pix.shape[0]} patches but {grid_key} {grid.tolist()} "
                f"needs {sum(counts)}; pass the processor's outputs for this sample unchanged"
            )
        secs = [1.0] * len(counts)
        if kind == 2 and sample.get("second_per_grid_ts") is not None:
            secs = [float(s) for s in torch.as_tensor(sample["second_per_grid_ts"]).reshape(-1).tolist()]
        out += [(kind, g, p, s, doc) for g, p, s in zip(grid, pix.split(counts), secs, strict=True)]
    return out


def collate_vision(
    samples: Mapping[int, Any], mb: MicroBatch, ranks: tuple[int, ...], rank: int, ignore_index: int = IGNORE_INDEX
) -> Batch:
    """This rank's `Batch` of a vision-language micro-batch (see the module docstring)."""
    text, items = {}, []
    for doc, sid in enumerate(mb.sample_ids):
        s = samples[sid]
        if isinstance(s, Tensor):  # a text-only sample as token ids (the profiler's synthetic samples)
            s = {"input_ids": s}
        if not isinstance(s, Mapping) or "input_ids" not in s:
            raise ValueError(
                f"vision-language sample {sid} must be a mapping with 'input_ids' (a processor's output "
                f"for one chat); got {type(s).__name__}"
            )
        crops = s.get("num_crops")
        if crops is not None and torch.as_tensor(crops).any():
            raise ValueError(
                f"vision-language sample {sid} has pan-and-scan crops (num_crops "
                f"{torch.as_tensor(crops).tolist()}), which dcparallel has not parity-tested (Gemma 3); "
                f"process its images with do_pan_and_scan=False"
            )
        text[sid] = {"input_ids": torch.as_tensor(s["input_ids"]).reshape(-1), "labels": s.get("labels")}
        items += _items(sid, s, doc)
    batch = collate_text(text, mb, ranks, rank, ignore_index)
    owner = deal_by_patches([int(g.prod()) for _, g, _, _, _ in items], batch.sp)
    mine = [p for (_, _, p, _, _), o in zip(items, owner, strict=True) if o == batch.rank_in_group]
    width = items[0][2].shape[1] if items else 0
    row = torch.cat([text[sid]["input_ids"].long() for sid in mb.sample_ids])[None]
    extras = {
        "row_ids": row,
        "vision_grid": torch.stack([g for _, g, _, _, _ in items]) if items else torch.zeros(0, 3, dtype=torch.long),
        "vision_kind": torch.tensor([k for k, _, _, _, _ in items], dtype=torch.long),
        "vision_doc": torch.tensor([d for _, _, _, _, d in items], dtype=torch.long),
        "vision_owner": torch.tensor(owner, dtype=torch.long),
        "vision_seconds": torch.tensor([s for _, _, _, s, _ in items], dtype=torch.float64).view(torch.int64),
        "pixels": torch.cat(mine) if mine else torch.zeros(0, width),
    }
    return dataclasses.replace(batch, extras=extras)
