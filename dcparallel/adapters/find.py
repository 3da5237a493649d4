"""`find_adapter`: the adapter that drives a model (its own, a reference, transformers, diffusers or the protocol)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from dcparallel.adapters.base import ModelAdapter, protocol_adapter


def find_adapter(
    model: nn.Module,
    *,
    layers: Sequence[nn.Module] | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    **protocol: Any,
) -> ModelAdapter:
    """The adapter for ``model``: a model that brings its own (``model.dcp_adapter()``), a
    reference model, a Hugging Face causal LM, a diffusers transformer with an adapter (Wan,
    ChronoEdit, SkyReels-V2, VACE, Helios, LTX-Video, Flux, Flux 2, Qwen-Image, HunyuanVideo,
    CogVideoX, Mochi; other diffusers models are refused with the reason), or any module
    following the protocol of `protocol_adapter`; a PEFT model as its base model
    (`adapters.peft`: LoRA, DoRA; other adapter types refused). ``layers`` / ``num_heads`` /
    ``num_kv_heads`` override what the adapter reads from the model."""
    if hasattr(model, "dcp_adapter"):
        return model.dcp_adapter()
    from dcparallel.adapters.peft import base_model

    model = base_model(model)  # a PeftModel is driven as its base model (`adapters.peft`)
    # imported here: the families' modules reach into data/ and runtime/, whose packages import the engine
    from dcparallel.adapters import (
        cogvideox,
        flux,
        flux2,
        hf,
        hunyuan_video,
        ltx,
        mochi,
        qwenimage,
        reference,
        unsupported,
        vlm,
        wan,
        wan_variants,
    )

    # unsupported last: it refuses every diffusers model no family before it matched
    # vlm before hf: a vision-language model is a transformers model that hf would take for a text LM
    for family in (
        reference,
        vlm,
        hf,
        wan,
        wan_variants,
        ltx,
        flux,
        flux2,
        qwenimage,
        hunyuan_video,
        cogvideox,
        mochi,
        unsupported,
    ):
        if family.matches(model):
            return family.adapter(model, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, **protocol)
    return protocol_adapter(model, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, **protocol)
