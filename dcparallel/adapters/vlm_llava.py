"""LLaVA-OneVision, `LlavaOnevisionForConditionalGeneration`: each image an item, its
any-resolution tiles (the base view, then the grid the processor chose from
``image_grid_pinpoints``) and its original (H, W) from ``image_sizes``, encoded whole on one
rank by the model's own ``get_image_features`` (tower, projector, then transformers'
``pack_image_features``: the grid's features unpadded to the image's aspect ratio, an
``image_newline`` row end, the base view first). A Qwen2 text decoder with 1-D positions.

The item's grid (`data.vision_collate`) is (tiles carried, H, W); a sample with several
images (``batch_num_images`` above 1) keeps only each image's base view, one tile, as the
model does for such a sample. Videos are refused in the collate.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn


def _used_tiles(cfg: Any, grid: list[int]) -> int:
    """Tiles the model encodes of an item: one (a multi-image sample's base view), or the
    base view and the pinpoint grid transformers' ``image_size_to_num_patches`` gives."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    if grid[0] == 1:
        return 1
    return image_size_to_num_patches(grid[1:], cfg.image_grid_pinpoints, cfg.vision_config.image_size)


def llava_tokens(cfg: Any, grid: Tensor) -> list[int]:
    """Language tokens of each item: transformers' ``pack_image_features`` run on zero
    features of the item's shape (one feature dim), so its unpadding, interpolation and
    newline rows decide the count."""
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    vc = cfg.vision_config
    side = vc.image_size // vc.patch_size
    cls = 1 if vc.model_type == "clip_vision_model" else 0  # SigLIP has no class token
    length = side * side + cls - (1 if cfg.vision_feature_select_strategy == "default" else 0)
    out = []
    for g in grid.tolist():
        feats = [torch.zeros(_used_tiles(cfg, g), length, 1)]
        packed, _ = LlavaOnevisionModel.pack_image_features(
            SimpleNamespace(config=cfg),
            feats,
            torch.tensor([g[1:]]),
            image_newline=torch.zeros(1),
            vision_aspect_ratio=cfg.vision_aspect_ratio,
        )
        out.append(int(packed[0].shape[0]))
    return out


def llava_encode(model: nn.Module, pixels: Tensor, grid: Tensor) -> Tensor:
    """Each row a tile (C, S, S) flattened, an item's ``grid[i][0]`` rows in turn; per item the
    model's own ``get_image_features`` on its used tiles with its ``image_sizes`` (a
    one-tile item as an image of a multi-image sample: ``batch_num_images`` 2)."""
    vc = model.config.vision_config
    tiles = pixels.reshape(-1, vc.num_channels, vc.image_size, vc.image_size)
    out = []
    for g, part in zip(grid.tolist(), tiles.split(grid[:, 0].tolist()), strict=True):
        n = _used_tiles(model.config, g)
        sizes = torch.tensor([g[1:]], device=pixels.device)
        many = None if g[0] > 1 else [2]  # need_patching False for this one image
        feats = model.model.get_image_features(pixel_values=part[:n], image_sizes=sizes, batch_num_images=many)
        out.append(torch.cat(list(feats.pooler_output)))
    return torch.cat(out)


def llava_logits(
    model: nn.Module, embeds: Tensor, positions: Tensor, mask: Tensor | None, levels: list[Tensor] | None
) -> Tensor:
    hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions, use_cache=False)
    return model.lm_head(hidden.last_hidden_state)
