"""The vision-language classes dcparallel trains, each as a `Family`: where its language model,
vision tower and projectors are, and how one micro-batch calls them (`adapters.vlm` drives
them the same way).

* Qwen2-VL, Qwen2.5-VL: the tower encodes patches of any (t, h, w) grid, merged 2 x 2 into
  language tokens (Qwen2.5-VL: window attention inside the tower); 3-D M-RoPE positions from
  the model's own ``get_rope_index``.
* Qwen3-VL: as Qwen2.5-VL, and DeepStack: features of inner tower blocks added to the hidden
  states after the first decoder layers at the placeholder tokens. They are encoded joined to
  the merged embeddings along the feature dim, so one exchange in the SP group carries all.
* InternVL: images as fixed-size tiles (each tile an item), pixel shuffle and an MLP projector
  outside the tower; a causal text decoder with 1-D positions (the packed row's own).
* Gemma 3: fixed-size images (each an item), a SigLIP tower, the projector outside it; its
  decoder's image tokens attend bidirectionally inside each image (`adapters.vlm_gemma3`).
* Idefics3, SmolVLM: as InternVL, fixed-size tiles (each tile an item) with a pixel mask per
  tile (its padding zero), a SigLIP-like tower that masks the padded patches, and the
  pixel-shuffle connector outside it; a Llama decoder with 1-D positions.
* LLaVA-OneVision: each image an item of any-resolution tiles, packed by the model's own
  ``get_image_features`` (`adapters.vlm_llava`); a Qwen2 decoder with 1-D positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters.vlm_gemma3 import gemma3_encode, gemma3_logits, gemma3_tokens
from dcparallel.adapters.vlm_llava import llava_encode, llava_logits, llava_tokens
from dcparallel.data.batch import Batch


@dataclass(frozen=True)
class Family:
    """Where a supported vision-language class keeps its parts, and how it is called."""

    text: str
    """attribute path of the language model (blocks, attention, ``set_attn_implementation``)"""
    tower: str
    """attribute path of the vision tower"""
    projectors: tuple[str, ...]
    """attribute paths of the projectors: trainable under ``freeze_vision`` (inside the tower
    or outside it)"""
    encode: Callable[[nn.Module, Tensor, Tensor], Tensor]
    """(model, patches, grids) -> (tokens, D x (1 + levels)): embeddings, then DeepStack levels"""
    tokens: Callable[[Any, Tensor], list[int]]
    """(config, grids (n, 3)) -> language tokens of each item"""
    positions: Callable[[nn.Module, Batch], Tensor]
    """(model, batch) -> this shard's position_ids, computed on the whole row and cut"""
    logits: Callable[..., Tensor]
    """(model, embeds, positions, placeholder mask or None, DeepStack rows or None) -> logits"""
    kinds: Callable[[Any], dict[int, int]]
    """config -> placeholder token id of each vision kind it takes (1 image, 2 video)"""
    levels: Callable[[Any], int] = lambda cfg: 0
    """DeepStack levels of a config (vision features added after the first decoder layers)"""
    needs_batch: bool = False
    """``logits`` also takes the batch (Gemma 3: its image blocks, computed on the whole row)"""


def _qwen_tokens(cfg: Any, grid: Tensor) -> list[int]:
    merge = cfg.vision_config.spatial_merge_size
    return (grid.prod(-1) // (merge * merge)).tolist()


def _qwen25_encode(model: nn.Module, pixels: Tensor, grid: Tensor) -> Tensor:
    tower = model.model.visual
    return tower(pixels.to(tower.dtype), grid_thw=grid).pooler_output


def _qwen3_encode(model: nn.Module, pixels: Tensor, grid: Tensor) -> Tensor:
    tower = model.model.visual
    out = tower(pixels.to(tower.dtype), grid_thw=grid)
    return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


def qwen_row_positions(model: nn.Module, batch: Batch) -> Tensor:
    """(3, seq_len) M-RoPE positions of the whole row: the model's ``get_rope_index`` on each
    document with its own images and videos (each document starts at 0, as a single sample)."""
    cfg = model.config
    ex = batch.extras
    row = ex["row_ids"].to(batch.inputs.device)
    grid, kind, doc = ex["vision_grid"], ex["vision_kind"], ex["vision_doc"]
    seconds = ex["vision_seconds"].view(torch.float64)
    out = []
    for d, (a, b) in enumerate(zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True)):
        ids = row[:, a:b]
        types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
        img, vid = (doc == d) & (kind == 1), (doc == d) & (kind == 2)
        pos, _ = model.model.get_rope_index(
            ids,
            types,
            image_grid_thw=grid[img] if img.any() else None,
            video_grid_thw=grid[vid] if vid.any() else None,
            second_per_grid_ts=seconds[vid] if vid.any() else None,
        )
        out.append(pos[:, 0])
    return torch.cat(out, dim=1)


def _qwen_positions(model: nn.Module, batch: Batch) -> Tensor:
    return batch.shard_sample(qwen_row_positions(model, batch).T).T[:, None]  # (3, 1, shard_len)


def _model_logits(
    model: nn.Module, embeds: Tensor, positions: Tensor, mask: Tensor | None, levels: list[Tensor] | None
) -> Tensor:
    return model(inputs_embeds=embeds, position_ids=positions, use_cache=False).logits


def _qwen3_logits(
    model: nn.Module, embeds: Tensor, positions: Tensor, mask: Tensor | None, levels: list[Tensor] | None
) -> Tensor:
    """The language model with the shard's DeepStack rows added after its first decoder
    layers at the shard's placeholder tokens (``mask``), then the LM head."""
    hidden = model.model.language_model(
        inputs_embeds=embeds,
        position_ids=positions,
        use_cache=False,
        visual_pos_masks=mask,
        deepstack_visual_embeds=levels,
    ).last_hidden_state
    return model.lm_head(hidden)


def _text_logits(
    model: nn.Module, embeds: Tensor, positions: Tensor, mask: Tensor | None, levels: list[Tensor] | None
) -> Tensor:
    """The language model and LM head called directly: InternVL's own forward hands its image
    arguments (``image_sizes``) down to the decoder's attention."""
    hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
    return model.lm_head(hidden.last_hidden_state)


def _internvl_tokens(cfg: Any, grid: Tensor) -> list[int]:
    """Per tile: its patches (pixels over the patch size) shrunk by the pixel shuffle."""
    ph, pw = cfg.vision_config.patch_size
    keep = cfg.downsample_ratio**2
    return [int(h // ph * (w // pw) * keep) for _, h, w in grid.tolist()]


def _internvl_encode(model: nn.Module, pixels: Tensor, grid: Tensor) -> Tensor:
    cfg = model.config
    _, h, w = grid[0].tolist()
    tiles = pixels.reshape(-1, cfg.vision_config.num_channels, h, w)
    out = model.model.get_image_features(
        pixel_values=tiles,
        vision_feature_layer=cfg.vision_feature_layer,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
    )
    return out.pooler_output.reshape(-1, out.pooler_output.shape[-1])


def _idefics3_tokens(cfg: Any, grid: Tensor) -> list[int]:
    """Per tile: its patches shrunk by the connector's pixel shuffle (``scale_factor`` squared)."""
    p, keep = cfg.vision_config.patch_size, cfg.scale_factor**2
    return [int(h // p * (w // p) // keep) for _, h, w in grid.tolist()]


def _idefics3_encode(model: nn.Module, pixels: Tensor, grid: Tensor) -> Tensor:
    """Each row a tile: its pixels (C, H, W), then its pixel mask (H, W), flattened
    (`data.vision_collate`); the model's own ``get_image_features`` (patch mask, tower,
    connector) on them."""
    if (grid != grid[0]).any():
        raise ValueError(
            f"{type(model).__name__}: tiles of different sizes {sorted(set(map(tuple, grid.tolist())))} "
            f"in one micro-batch; pass the image processor's tiles (all of its max_image_size)"
        )
    _, h, w = grid[0].tolist()
    size = model.config.vision_config.num_channels * h * w
    tiles = pixels[:, :size].reshape(1, -1, model.config.vision_config.num_channels, h, w)
    mask = pixels[:, size:].reshape(1, -1, h, w) != 0
    return torch.cat(list(model.model.get_image_features(pixel_values=tiles, pixel_attention_mask=mask).pooler_output))


def _idefics3_logits(
    model: nn.Module, embeds: Tensor, positions: Tensor, mask: Tensor | None, levels: list[Tensor] | None
) -> Tensor:
    hidden = model.model.text_model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
    return model.lm_head(hidden.last_hidden_state)


def _qwen_kinds(cfg: Any) -> dict[int, int]:
    return {1: cfg.image_token_id, 2: cfg.video_token_id}


def _row_positions(model: nn.Module, batch: Batch) -> Tensor:
    """1-D positions: the packed row's own (decoders without M-RoPE)."""
    return batch.positions


def _image_kind(cfg: Any) -> dict[int, int]:
    return {1: cfg.image_token_id}


FAMILIES = {
    **{
        name: Family(
            "model.language_model",
            "model.visual",
            ("model.visual.merger",),
            _qwen25_encode,
            _qwen_tokens,
            _qwen_positions,
            _model_logits,
            _qwen_kinds,
        )
        for name in ("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration")
    },
    "Qwen3VLForConditionalGeneration": Family(
        "model.language_model",
        "model.visual",
        ("model.visual.merger", "model.visual.deepstack_merger_list"),
        _qwen3_encode,
        _qwen_tokens,
        _qwen_positions,
        _qwen3_logits,
        _qwen_kinds,
        lambda cfg: len(cfg.vision_config.deepstack_visual_indexes),
    ),
    "InternVLForConditionalGeneration": Family(
        "model.language_model",
        "model.vision_tower",
        ("model.multi_modal_projector",),
        _internvl_encode,
        _internvl_tokens,
        _row_positions,
        _text_logits,
        _image_kind,
    ),
    **{
        name: Family(
            "model.text_model",
            "model.vision_model",
            ("model.connector",),
            _idefics3_encode,
            _idefics3_tokens,
            _row_positions,
            _idefics3_logits,
            _image_kind,
        )
        for name in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
    },
    "Gemma3ForConditionalGeneration": Family(
        "model.language_model",
        "model.vision_tower",
        ("model.multi_modal_projector",),
        gemma3_encode,
        gemma3_tokens,
        _row_positions,
        gemma3_logits,
        _image_kind,
        needs_batch=True,
    ),
    "LlavaOnevisionForConditionalGeneration": Family(
        "model.language_model",
        "model.vision_tower",
        ("model.multi_modal_projector",),
        llava_encode,
        llava_tokens,
        _row_positions,
        llava_logits,
        _image_kind,
    ),
}
