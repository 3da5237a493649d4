"""Hugging Face transformers decoder-only causal LMs (Llama, Qwen2/Qwen3, Mistral, ... —
any ``*ForCausalLM`` whose decoder layers sit in ``model.model.layers`` with ``self_attn``
and ``mlp``).

Attention goes through transformers' own registry: `AttentionInterface.register` under the
name ``"dcparallel"`` and ``model.set_attn_implementation("dcparallel")``; the function and
its keyword contract (each keyword handled exactly or refused) are `hf_attention`'s. For a name its mask
registry does not know, transformers builds no mask and passes ``attention_mask=None``, so
the function applies causality and the packed row's document boundaries itself (the
runtime's attention does both). The model is called by keyword with ``position_ids`` (each
document's positions, global over the SP shard) and ``use_cache=False``, without
``labels``: the loss stays dcparallel's (shifted before sharding, summed, normalized once
per step). Grouped-query attention arrives with k, v of fewer heads, as Ulysses takes them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from dcparallel.adapters import hf_attention as attention
from dcparallel.adapters.base import ModelAdapter, derive_spec, random_tokens
from dcparallel.adapters.hf_attention import hf_attention  # noqa: F401  (the function transformers calls)


def matches(model: nn.Module) -> bool:
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(b, "self_attn") and hasattr(b, "mlp") for b in layers):
        raise ValueError(f"{type(model).__name__} is a transformers model but not a decoder-only causal LM with "
                         f"decoder layers in model.model.layers (each with self_attn and mlp); dcparallel drives "
                         f"*ForCausalLM models such as LlamaForCausalLM, Qwen3ForCausalLM, MistralForCausalLM")
    return list(layers)


def _head_dims(cfg: Any) -> tuple[int, int]:
    """(query/key, value) head sizes: multi-head latent attention (DeepSeek-V2/V3) has a
    query/key head of qk_nope_head_dim + qk_rope_head_dim (its ``head_dim`` is the rotary
    part only) and a value head of v_head_dim; other models one ``head_dim``."""
    if getattr(cfg, "qk_nope_head_dim", None) is not None and getattr(cfg, "qk_rope_head_dim", None) is not None:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    else:
        qk = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return qk, getattr(cfg, "v_head_dim", None) or qk


def hf_lm_loss(model: nn.Module, batch: Any, ctx: Any) -> Tensor:
    """One micro-batch of a transformers causal LM: keyword call with the packed row's
    per-document ``position_ids``, no KV cache, no labels; the summed next-token loss."""
    logits = model(input_ids=batch.inputs, position_ids=batch.positions, use_cache=False).logits
    return ctx.lm_loss(logits)


def adapter(model: nn.Module, *, layers=None, num_heads=None, num_kv_heads=None, loss_fn=None, sample_fn=None,
            name: str | None = None, **unused: Any) -> ModelAdapter:
    if unused:
        raise ValueError(f"unexpected arguments for a transformers model: {sorted(unused)}")
    cfg = model.config
    blocks = list(layers) if layers is not None else _decoder_layers(model)
    own_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    for what, given, own in (("num_heads", num_heads, cfg.num_attention_heads), ("num_kv_heads", num_kv_heads, own_kv)):
        if given is not None and given != own:
            raise ValueError(f"{what}={given} but the model's config has {own}; leave {what} out (it is read from "
                             f"model.config)")
    heads, kv = cfg.num_attention_heads, own_kv
    qk_dim, v_dim = _head_dims(cfg)
    vocab = cfg.vocab_size
    attn_modules = lambda b: [b.self_attn]
    mlp_modules = lambda b: [b.mlp]
    spec = derive_spec(model, blocks, name=name or f"{cfg.model_type}-h{cfg.hidden_size}-l{len(blocks)}",
                       kind="text", hidden=cfg.hidden_size, num_heads=heads, ffn_hidden=cfg.intermediate_size,
                       attention="causal", attn_modules=attn_modules, mlp_modules=mlp_modules, vocab_size=vocab,
                       num_kv_heads=kv if kv != heads else 0,
                       head_dim=qk_dim if qk_dim * heads != cfg.hidden_size else 0,
                       v_head_dim=v_dim if v_dim != qk_dim else 0)

    def install(fn: Any) -> None:
        attention.install(model, [b.self_attn for b in blocks], fn)

    return ModelAdapter(name=spec.name, kind="text", blocks=blocks, num_heads=heads, num_kv_heads=kv,
                        install_attention=install, spec=spec, attn_modules=attn_modules, mlp_modules=mlp_modules,
                        loss_fn=loss_fn or hf_lm_loss, sample=sample_fn or random_tokens(vocab), collate="text")
