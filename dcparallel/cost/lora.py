"""A model planned as a LoRA fine-tune: its base frozen, adapters trained (`with_lora`)."""

from __future__ import annotations

import dataclasses

from dcparallel.spec import ModelSpec


def with_lora(model: ModelSpec, rank: int) -> ModelSpec:
    """``model`` fine-tuned with LoRA of ``rank`` on every linear layer of its blocks: the base
    frozen, rank x (inputs + outputs) adapter parameters per linear trained. The linears are
    read from the per-layer counts as square hidden x hidden ones (attention, and the
    ``other_params`` cross-attention) and hidden x ffn ones (MLP), an estimate (grouped k / v
    projections are narrower); the adapters count in ``other_params`` (their FLOPs too)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1; got {rank}")
    d, f = model.hidden, model.ffn_hidden
    per_layer = rank * (2 * (model.attn_params + model.other_params) // d + model.mlp_params * (d + f) // (d * f))
    return dataclasses.replace(
        model,
        name=f"{model.name}-lora{rank}",
        other_params=model.other_params + per_layer,
        frozen_params=model.num_params,
        max_unit_params=model.max_unit_params + per_layer if model.max_unit_params else 0,
    )
