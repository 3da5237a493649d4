"""Hugging Face transformers decoder-only causal LMs (Llama, Qwen2/Qwen3, Mistral, GPT-NeoX,
GraniteMoE, ... — any ``*ForCausalLM`` whose decoder layers' attention goes through
transformers' attention interface). The blocks, their attention and MLP sub-modules, and the
layers that must be refused (linear attention, state-space, convolutions, attention that
computes its kernel or mask itself) are read from the model's structure by
`adapters.hf_structure`; ``layers=``, ``attn_modules=`` and ``mlp_modules=`` override them.

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
from dcparallel.adapters.hf_structure import DocumentLimit, document_limit, ffn_size, resolve
from dcparallel.models.attention import AttnPattern

NAME = "dcparallel"
CAUSAL = AttnPattern("causal")


def matches(model: nn.Module) -> bool:
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


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


def _config_int(cfg: Any, *names: str) -> int | None:
    for n in names:
        value = getattr(cfg, n, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def adapter(model: nn.Module, *, layers=None, num_heads=None, num_kv_heads=None, loss_fn=None, sample_fn=None,
            name: str | None = None, attn_modules=None, mlp_modules=None, **unused: Any) -> ModelAdapter:
    """``attn_modules`` / ``mlp_modules``: ``block -> [modules]`` overrides of the attention
    (classes that call transformers' attention interface) and feed-forward sub-modules."""
    if unused:
        raise ValueError(f"unexpected arguments for a transformers model: {sorted(unused)}")
    cfg = model.config
    blocks, attn_of, mlp_of = resolve(model, layers, attn_modules, mlp_modules)
    own_heads = _config_int(cfg, "num_attention_heads", "n_head", "num_heads")
    if own_heads is None:
        raise ValueError(f"{type(model).__name__}'s config has no num_attention_heads; pass num_heads=")
    own_kv = _config_int(cfg, "num_key_value_heads", "num_kv_heads") or own_heads
    for what, given, own in (("num_heads", num_heads, own_heads), ("num_kv_heads", num_kv_heads, own_kv)):
        if given is not None and given != own:
            raise ValueError(f"{what}={given} but the model's config has {own}; leave {what} out (it is read from "
                             f"model.config)")
    heads, kv = own_heads, own_kv
    vocab = cfg.vocab_size
    hidden = cfg.hidden_size
    spec = derive_spec(model, blocks, name=name or f"{cfg.model_type}-h{hidden}-l{len(blocks)}",
                       kind="text", hidden=hidden, num_heads=heads, ffn_hidden=ffn_size(cfg, blocks, hidden),
                       attention="causal", attn_modules=attn_of, mlp_modules=mlp_of, vocab_size=vocab,
                       num_kv_heads=kv if kv != heads else 0)

    limits = {id(m): document_limit(model, i, m) for i, b in enumerate(blocks) for m in attn_of(b)}

    def install(fn: Any) -> None:
        _register()
        for b in blocks:
            for m in attn_of(b):
                limit = limits[id(m)]
                m._dcp_attention = fn if limit is None else DocumentLimit(fn, *limit)
        model.set_attn_implementation(NAME)

    return ModelAdapter(name=spec.name, kind="text", blocks=blocks, num_heads=heads, num_kv_heads=kv,
                        install_attention=install, spec=spec, attn_modules=attn_of, mlp_modules=mlp_of,
                        loss_fn=loss_fn or hf_lm_loss, sample=sample_fn or random_tokens(vocab), collate="text")
