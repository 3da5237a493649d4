"""transformers families whose attention needs more than a plain causal softmax, built from
tiny configs (never downloaded) for the parity tests: Gemma 2 (logit softcapping, sliding
window on alternate layers), gpt-oss (per-head learned attention sinks, sliding window,
MoE) and DeepSeek-V3 (multi-head latent attention: value head size 6, query/key head size
12; one dense and one MoE layer). 4 query heads each, so SP 4 divides them.

The unmodified reference runs transformers' eager attention (its SDPA refuses softcapping
and has no sinks): eager is the reference semantics."""

from __future__ import annotations

import torch
from torch import nn

KINDS = ("hf-gemma2", "hf-gpt-oss", "hf-deepseek-v3")
VOCAB = 96

#: Gemma 2's attention logit cap in the tests: with weights of std 0.5 and a unit query
#: pre-attention scalar, logits reach tens, where tanh capping changes the result
GEMMA2_SOFTCAP = 20.0


def build(kind: str, seed: int = 0, *, softcap: bool = True) -> nn.Module:
    """A tiny fp32 model of ``kind`` with eager attention (``softcap=False``: Gemma 2
    without its attention softcapping, to show that the capping matters)."""
    torch.manual_seed(seed)
    if kind == "hf-gemma2":  # GQA 4/2, layers sliding (window 64 > every document) then full
        from transformers import Gemma2Config, Gemma2ForCausalLM

        cfg = Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
            initializer_range=0.5,
            query_pre_attn_scalar=1,
            sliding_window=64,
            attn_logit_softcapping=GEMMA2_SOFTCAP if softcap else None,
        )
        return Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager").float()
    if kind == "hf-gpt-oss":  # GQA 4/2, sinks of std 1 (so they weigh), 2 experts, top-1
        from transformers import GptOssConfig, GptOssForCausalLM

        cfg = GptOssConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=32 * 4096,  # YaRN's factor 32 over its 4096 original positions
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=64,
        )
        model = GptOssForCausalLM._from_config(cfg, attn_implementation="eager").float()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
        return model
    if kind == "hf-deepseek-v3":  # MLA: q/k head 8 + 4 rotary, v head 6; layer 0 dense, layer 1 MoE
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=6,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            max_position_embeddings=256,
        )
        return DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="eager").float()
    raise ValueError(f"unknown family {kind!r}; one of {KINDS}")
