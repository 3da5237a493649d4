"""The `VisionTower` of a built vision-language model, as the cost model prices it: the
blocks' exact parameter counts, the full-attention blocks and the window of the others, the
patch and merge sizes. Grid-based towers only (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: a
``vision_config.spatial_merge_size`` and ``model.visual.blocks``); InternVL's fixed-size
tiles have no grid to price per image, so its spec has no tower.

Used by the VLM adapter (`adapters.vlm`: the spec `DataCentricParallel` plans and profiles
with) and by `apps.model_config` (a spec from a config alone, which adds the folder's image
processor pixel bounds).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from dcparallel.adapters.base import count_params
from dcparallel.spec import ModelSpec, VisionTower


def has_grid_tower(model: nn.Module) -> bool:
    """True for a model whose tower grids images into patches (the Qwen-VL families)."""
    vc = getattr(getattr(model, "config", None), "vision_config", None)
    visual = getattr(getattr(model, "model", None), "visual", None)
    return hasattr(vc, "spatial_merge_size") and hasattr(visual, "blocks")


def vision_tower(model: nn.Module, trainable: bool = True, **bounds: Any) -> VisionTower:
    """The tower of ``model`` (module docstring); ``bounds``: the image processor's
    ``min_pixels`` / ``max_pixels`` (the `VisionTower` defaults without them)."""
    if not has_grid_tower(model):
        raise ValueError(
            f"{type(model).__name__}: its vision tower has no grid of patches to price (Qwen2-VL, "
            f"Qwen2.5-VL and Qwen3-VL have); plan it without a vision tower"
        )
    visual, vc = model.model.visual, model.config.vision_config
    blocks = list(visual.blocks)
    per_block = count_params([blocks[0]])
    windowed = getattr(vc, "window_size", 0) and getattr(vc, "fullatt_block_indexes", None) is not None
    full = len(vc.fullatt_block_indexes) if windowed else len(blocks)
    window = (vc.window_size // vc.patch_size) ** 2 if windowed else 0
    return VisionTower(
        num_layers=len(blocks),
        hidden=getattr(vc, "embed_dim", None) or vc.hidden_size,
        layer_params=per_block,
        full_layers=full,
        window=window,
        trainable=trainable,
        extra_params=count_params([visual]) - len(blocks) * per_block,
        patch=vc.patch_size,
        merge=vc.spatial_merge_size,
        **bounds,
    )


def with_tower(spec: ModelSpec, model: nn.Module, trainable: bool = True) -> ModelSpec:
    """``spec`` (of the whole model) with its tower priced apart: the tower's parameters move
    from ``extra_params`` to ``spec.vision``; unchanged for a model without a grid tower."""
    if not has_grid_tower(model):
        return spec
    tower = vision_tower(model, trainable)
    return dataclasses.replace(spec, extra_params=spec.extra_params - tower.num_params, vision=tower)
