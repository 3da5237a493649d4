"""The planner's `ModelSpec` of a transformers or diffusers model from its config file alone.

`dcparallel simulate --model-config config.json` plans for models too large to build here:
the model is built on the meta device (shapes only, no weights, no memory), in bf16, and its
spec comes from the same adapter `DataCentricParallel` would use (`adapters.find_adapter`),
so the parameter counts are exact. A diffusers config names its class (``_class_name``); any
other JSON is a transformers config (``model_type``). Video sizes are planned in pixels: the
adapter's latent rule is widened by a 4x temporal / 8x spatial VAE (Wan's), so the built-in
video distributions and pixel lengths files apply.

A vision-language config (a ``vision_config``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is built as its
image-text-to-text class; its adapter's spec holds the vision tower as the cost model prices
it (`spec.VisionTower`, `adapters.vlm_tower`), here with the image processor's pixel bounds
from the folder's ``preprocessor_config.json`` (the tower's defaults without one).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dcparallel.spec import ModelSpec

#: the VAE between pixels and the transformer's latents: (temporal, spatial) downsampling
VAE_FACTORS = (4, 8)


def _read(path: Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"cannot read the model config {p}: {exc}; give a transformers or diffusers config.json"
        ) from None
    if not isinstance(d, dict):
        raise ValueError(f"{p} holds {type(d).__name__}, not a config object; give a config.json")
    return d


def _transformers(d: dict, path: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if "model_type" not in d:
        raise ValueError(
            f"{path} has neither '_class_name' (a diffusers config) nor 'model_type' (a transformers "
            f"config); give the model's config.json"
        )
    try:
        cfg = AutoConfig.for_model(**d)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{path}: transformers does not know model_type {d['model_type']!r} ({exc})") from None
    try:
        with torch.device("meta"):
            if "vision_config" in d:
                from transformers import AutoModelForImageTextToText

                return AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16)
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    except ValueError as exc:
        raise ValueError(
            f"{path}: {type(cfg).__name__} has no causal-LM class ({exc}); dcparallel plans "
            f"decoder-only *ForCausalLM models and diffusers' WanTransformer3DModel"
        ) from None


def _diffusers(d: dict, path: Path):
    import diffusers
    import torch

    name = d["_class_name"]
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise ValueError(f"{path}: {name!r} is not a diffusers model class")
    with torch.device("meta"):
        return cls.from_config(d).to(torch.bfloat16)


def _pixel_bounds(folder: Path) -> dict:
    """VisionTower's min_pixels / max_pixels from the folder's image processor config, if any."""
    try:
        d = json.loads((folder / "preprocessor_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    size = d.get("size") or {}
    lo, hi = size.get("shortest_edge", d.get("min_pixels")), size.get("longest_edge", d.get("max_pixels"))
    return {"min_pixels": int(lo), "max_pixels": int(hi)} if lo and hi else {}


def spec_from_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """The `ModelSpec` of the model a transformers or diffusers config file describes (built on
    the meta device; see the module docstring). ``name`` defaults to the file's folder or stem."""
    from dcparallel.adapters import find_adapter
    from dcparallel.adapters.vlm_tower import vision_tower

    path = Path(path)
    d = _read(path)
    model = _diffusers(d, path) if "_class_name" in d else _transformers(d, path)
    try:
        spec = find_adapter(model).spec
    except ValueError as exc:
        raise ValueError(f"{path}: dcparallel has no adapter for {type(model).__name__} ({exc})") from None
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        if spec.vision is None:  # the adapter gives grid towers theirs (`adapters.vlm_tower`)
            vision_tower(model)  # raises: the tower has no grid to price
        bounds = _pixel_bounds(path if path.is_dir() else path.parent)
        spec = dataclasses.replace(spec, vision=dataclasses.replace(spec.vision, **bounds))
    if spec.kind == "video":
        t, s = VAE_FACTORS
        spec = dataclasses.replace(spec, t_num=spec.t_num, t_den=spec.t_den * t, spatial_patch=spec.spatial_patch * s)
    label = name or (path.name if path.is_dir() else path.parent.name if path.stem == "config" else path.stem)
    return dataclasses.replace(spec, name=label)
