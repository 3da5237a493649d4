"""Hugging Face transformers decoder-only causal LMs (Llama, Qwen2/Qwen3, Mistral, ... —
any ``*ForCausalLM`` whose decoder layers sit in ``model.model.layers`` with ``self_attn``
and ``mlp``).

Attention goes through transformers' own registry: `AttentionInterface.register` under the
name ``"dcparallel"`` and ``model.set_attn_implementation("dcparallel")``. For a name its mask
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

from dcparallel.adapters.base import ModelAdapter, derive_spec, random_tokens
from dcparallel.models.attention import AttnPattern

NAME = "dcparallel"
CAUSAL = AttnPattern("causal")


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


def hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                 **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature: q (B, H, L, D), k, v (B, H_kv, L, D) ->
    ((B, L, H, D), no weights), through the runtime attention installed on ``module``."""
    fn = getattr(module, "_dcp_attention", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__} runs dcparallel's attention but none was installed; wrap the "
                           f"model with dcparallel.DataCentricParallel first")
    if attention_mask is not None:
        raise ValueError("dcparallel's attention builds causality and document boundaries itself; call the model "
                         "without attention_mask (pass position_ids=batch.positions)")
    if dropout and module.training:
        raise ValueError(f"attention dropout {dropout} is not supported under dcparallel; set the config's "
                         f"attention_dropout to 0")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    d = q.shape[-1]
    if scaling is not None and abs(scaling * d**0.5 - 1.0) > 1e-9:
        q = q * (scaling * d**0.5)  # the kernel scales by 1/sqrt(D)
    if sliding_window is not None:
        longest = fn.longest_document(q.shape[1])
        if longest > sliding_window:
            raise ValueError(f"a document of {longest} tokens is longer than the model's sliding window "
                             f"{sliding_window}; dcparallel's attention is full causal: set the config's "
                             f"sliding_window to None or keep documents within it")
    return fn(q, k, v, CAUSAL), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, hf_attention)


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
    vocab = cfg.vocab_size
    attn_modules = lambda b: [b.self_attn]
    mlp_modules = lambda b: [b.mlp]
    spec = derive_spec(model, blocks, name=name or f"{cfg.model_type}-h{cfg.hidden_size}-l{len(blocks)}",
                       kind="text", hidden=cfg.hidden_size, num_heads=heads, ffn_hidden=cfg.intermediate_size,
                       attention="causal", attn_modules=attn_modules, mlp_modules=mlp_modules, vocab_size=vocab,
                       num_kv_heads=kv if kv != heads else 0)

    def install(fn: Any) -> None:
        _register()
        for b in blocks:
            b.self_attn._dcp_attention = fn
        model.set_attn_implementation(NAME)

    return ModelAdapter(name=spec.name, kind="text", blocks=blocks, num_heads=heads, num_kv_heads=kv,
                        install_attention=install, spec=spec, attn_modules=attn_modules, mlp_modules=mlp_modules,
                        loss_fn=loss_fn or hf_lm_loss, sample=sample_fn or random_tokens(vocab), collate="text")
