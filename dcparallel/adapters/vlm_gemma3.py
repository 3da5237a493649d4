"""Gemma 3 (vision), `Gemma3ForConditionalGeneration`: a SigLIP tower over fixed-size images
(each image one item, `data.vision_collate`), the multi-modal projector (average pool, norm,
projection) outside it, the image embeddings at the placeholder tokens, and a Gemma 3 text
decoder with 1-D positions whose attention is causal OR (query and key in the same image's
token block), on its sliding-window layers too (AND the window, as transformers' Gemma 3
masks: ``token_type_ids`` 1 on the image tokens, a block a run of them).

The blocks are computed on the whole packed row before sharding (`image_blocks`, per
document: a block never reaches into the next document) and handed to the attention kernel
as dcparallel's own keyword (`hf_attention.BLOCKS`, `AttnPattern.blocks`): under Ulysses each
rank attends over the whole row for its heads, so the intervals suffice. Ring attention
refuses them. Pan-and-scan crops are refused in the collate (``num_crops``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters.hf_attention import BLOCKS
from dcparallel.data.batch import Batch


def gemma3_tokens(cfg: Any, grid: Tensor) -> list[int]:
    """Every image gives ``mm_tokens_per_image`` tokens (the projector pools its patches)."""
    return [int(cfg.mm_tokens_per_image)] * len(grid)


def gemma3_encode(model: nn.Module, pixels: Tensor, grid: Tensor) -> Tensor:
    """Each row an image (C, H, W) flattened; the model's own ``get_image_features`` (tower,
    projector) on them, all of the configured size."""
    vc = model.config.vision_config
    if (grid[:, 1:] != vc.image_size).any():
        raise ValueError(
            f"{type(model).__name__}: images of sizes {sorted({tuple(g[1:]) for g in grid.tolist()})} "
            f"but its tower takes {vc.image_size} x {vc.image_size}; pass the image processor's output"
        )
    tiles = pixels.reshape(-1, vc.num_channels, vc.image_size, vc.image_size)
    out = model.model.get_image_features(pixel_values=tiles).pooler_output
    return out.reshape(-1, out.shape[-1])


def image_blocks(batch: Batch, image_token: int) -> tuple[tuple[int, int], ...]:
    """[start, end) of each run of image tokens in the whole row, per document (transformers'
    image groups: consecutive ``token_type_ids`` 1)."""
    row = batch.extras["row_ids"][0]
    out = []
    for a, b in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True):
        is_img = torch.nn.functional.pad((row[a:b] == image_token).int(), (1, 1))
        edges = (is_img[1:] - is_img[:-1]).nonzero()[:, 0].tolist()  # starts (+1) and ends (-1) alternate
        out += [(a + s, a + e) for s, e in zip(edges[::2], edges[1::2], strict=True)]
    return tuple(out)


def gemma3_logits(
    model: nn.Module, embeds: Tensor, positions: Tensor, mask: Tensor | None, levels: list[Tensor] | None, batch: Batch
) -> Tensor:
    """The text decoder with the row's image blocks bidirectional, then the LM head (the
    model's own forward caps no logits: ``final_logit_softcapping`` is its causal LM's)."""
    blocks = image_blocks(batch, model.config.image_token_id)
    hidden = model.model.language_model(
        inputs_embeds=embeds, position_ids=positions, use_cache=False, **{BLOCKS: blocks}
    )
    return model.lm_head(hidden.last_hidden_state)
