"""Models with frozen parts for the LoRA / frozen-parameter tests, built from configs (never
downloaded): PEFT LoRA on a transformers Llama (grouped-query attention), DoRA together with
LoRA on the token embeddings, a diffusers Wan given LoRA in place (``add_adapter``, as diffusers'
training scripts do), and a Llama whose embeddings and first block are frozen. Adapters start
random (``init_lora_weights=False``): with LoRA's default zero B every A would get a zero
gradient and the parity tests could not see a wrong one."""

from __future__ import annotations

import torch
from torch import nn

from tests import adapter_models

#: kind -> the library model it adapts (`tests.adapter_models`: data and reference)
BASE = {"lora-llama": "hf-llama", "dora-emb-llama": "hf-llama", "lora-wan": "wan", "frozen-llama": "hf-llama"}
KINDS = tuple(BASE)
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WAN_LINEARS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def build(
    kind: str, seed: int = 0, base_dtype: torch.dtype | None = None, adapter_seed: int | None = None
) -> nn.Module:
    """The model of ``kind``, the same for the same seeds (``adapter_seed``: the adapters'
    initialization, default ``seed + 1``). ``base_dtype``: the frozen parameters cast to it
    (the adapters stay fp32)."""
    from peft import LoraConfig, get_peft_model

    model = adapter_models.build(BASE[kind], seed)
    torch.manual_seed(seed + 1 if adapter_seed is None else adapter_seed)
    if kind == "lora-llama":
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_LINEARS, init_lora_weights=False)
        )
    elif kind == "dora-emb-llama":
        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=4,
                use_dora=True,
                init_lora_weights=False,
                target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
            ),
        )
    elif kind == "lora-wan":
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=WAN_LINEARS, init_lora_weights=False))
    elif kind == "frozen-llama":  # a frozen text part: the embeddings and the first block
        for p in [*model.model.embed_tokens.parameters(), *model.model.layers[0].parameters()]:
            p.requires_grad_(False)
    if base_dtype is not None:
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(base_dtype)
    return model


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adapter_numel(model: nn.Module) -> int:
    """Elements of the adapters (LoRA A / B, DoRA magnitudes, embedding A / B) by name."""
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
