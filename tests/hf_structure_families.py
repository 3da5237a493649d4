"""transformers causal-LM families for the structure tests, built from tiny configs (never
downloaded), their packed-document data and the single-process reference (the unmodified
model, one document at a time, plain autograd).

``PARITY``: families whose blocks live elsewhere or whose sub-modules have other names
(GPT-NeoX: ``gpt_neox.layers`` with ``attention``; GraniteMoE: ``block_sparse_moe`` and
attention/residual/logit multipliers; Llama 4 text: ``feed_forward`` MoE with a shared
expert, chunked attention and a no-RoPE layer). ``REFUSED``: families dcparallel must refuse, with the
words the message must contain. ``tiny(model_type)``: any family's tiny config, for the
world-1 smoke over the supported families.
"""

from __future__ import annotations

import os
import random

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support import Data

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
#: what every tiny config sets where the family has the field (hidden 64, 2 layers, 4 heads, GQA 2)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_routed_experts=4,
    shared_expert_intermediate_size=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(model_type: str, **overrides):
    """A tiny config of a family: `TINY` where the config class has the field, then ``overrides``."""
    from transformers import AutoConfig

    cls = type(AutoConfig.for_model(model_type))
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    kw = {
        k: v
        for k, v in TINY.items()
        if (k in fields or hasattr(cls, k)) and not isinstance(getattr(cls, k, None), property)
    }
    kw.update(overrides)
    return cls(**kw)


def tiny(model_type: str, seed: int = 0, meta: bool = False, **overrides) -> nn.Module:
    """The family's causal LM of `tiny_config`, fp32 (``meta``: on the meta device, for
    structure-only checks)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = tiny_config(model_type, **overrides)
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return cls._from_config(cfg)
    return cls._from_config(cfg, attn_implementation="sdpa").float()


PARITY: dict[str, dict] = {
    "gpt_neox": dict(intermediate_size=96, rotary_pct=0.5, use_parallel_residual=True),
    "granitemoe": dict(
        intermediate_size=32,
        attention_multiplier=0.25,
        embedding_multiplier=2.0,
        residual_multiplier=0.7,
        logits_scaling=1.5,
    ),
    "llama4_text": dict(intermediate_size=32, intermediate_size_mlp=64, num_experts_per_tok=1, no_rope_layers=[1, 0]),
}


def build(kind: str, seed: int = 0) -> nn.Module:
    return tiny(kind, seed, **PARITY[kind])


#: family -> (config overrides, words the refusal must contain)
REFUSED: dict[str, tuple[dict, tuple[str, ...]]] = {
    "qwen3_next": (
        dict(
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        (
            "Qwen3NextForCausalLM",
            "layer 0",
            "'linear_attention'",
            "linear_attn (Qwen3NextGatedDeltaNet)",
            "recurrent state",
            "across documents even at SP 1",
            "Fix:",
        ),
    ),
    "minimax": (
        dict(layer_types=["linear_attention", "full_attention"]),
        (
            "MiniMaxForCausalLM",
            "layer 0",
            "'linear_attention'",
            "self_attn (MiniMaxLightningAttention)",
            "not through transformers' attention interface",
            "Fix:",
        ),
    ),
    "granitemoehybrid": (
        dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16),
        ("GraniteMoeHybridForCausalLM", "layer 0", "mamba (GraniteMoeHybridMambaLayer)", "recurrent state", "Fix:"),
    ),
    "lfm2": (
        dict(layer_types=["conv", "full_attention"]),
        ("Lfm2ForCausalLM", "layer 0", "'conv'", "conv (Lfm2ShortConv)", "Fix:"),
    ),
    "falcon_h1": (
        dict(),
        ("FalconH1ForCausalLM", "layer 0", "'hybrid'", "beside its attention", "mamba (FalconH1Mixer)", "Fix:"),
    ),
    "doge": (
        dict(),
        (
            "DogeForCausalLM",
            "layer 0",
            "DogeAttention",
            "learned dynamic mask",
            "no attention_mask argument of yours causes it",
            "Fix:",
        ),
    ),
    "falcon": (
        dict(new_decoder_architecture=True, num_kv_heads=2),
        (
            "FalconForCausalLM",
            "layer 0",
            "self_attention (FalconAttention)",
            "itself",
            "not through transformers' attention interface",
            "across packed documents",
            "Fix:",
        ),
    ),
}


def refused(kind: str) -> nn.Module:
    return tiny(kind, meta=True, **REFUSED[kind][0])


def make_data(num_samples: int, seed: int) -> Data:
    """Documents of 2-37 random tokens (packed unevenly by the plans)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    docs = {}
    for i in range(num_samples):
        docs[i] = torch.randint(0, VOCAB, (rng.randint(2, 37),), generator=g)
    return Data("hf-structure", docs, {}, {}, {}, {i: tuple(d.shape) for i, d in docs.items()})


def reference(model: nn.Module, data: Data, sample_ids) -> tuple[float, dict[str, Tensor]]:
    """Mean next-token loss over every target of the documents and its gradient, one
    document at a time through the unmodified model."""
    model.zero_grad(set_to_none=True)
    losses, count = [], 0
    for sid in sample_ids:
        d = data.docs[sid][None]
        logits = model(input_ids=d, use_cache=False).logits
        losses.append(F.cross_entropy(logits[0, :-1].float(), d[0, 1:], reduction="sum"))
        count += d.shape[1] - 1
    loss = torch.stack(losses).sum() / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
