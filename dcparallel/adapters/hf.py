"""Hugging Face transformers decoder-only causal LMs (Llama, Qwen2/Qwen3, Mistral, GPT-NeoX,
GraniteMoE, ... — any ``*ForCausalLM`` whose decoder layers' attention goes through
transformers' attention interface). The blocks, their attention and MLP sub-modules, and the
layers that must be refused (linear attention, state-space, convolutions, attention that
computes its kernel or mask itself) are read from the model's structure by
`adapters.hf_structure`; ``layers=``, ``attn_modules=`` and ``mlp_modules=`` override them.

Attention goes through transformers' own registry: `AttentionInterface.register` under the
name ``"dcparallel"`` and ``model.set_attn_implementation("dcparallel")``; the function and
its keyword contract (each keyword handled exactly or refused) are `hf_attention`'s. For a
name its mask registry does not know, transformers builds no mask and passes ``attention_mask=None``, so
the function applies causality and the packed row's document boundaries itself (the
runtime's attention does both). The model is called by keyword with ``position_ids`` (each
document's positions, global over the SP shard) and ``use_cache=False``, without
``labels``: the loss stays dcparallel's (shifted before sharding, summed, normalized once
per step). Grouped-query attention arrives with k, v of fewer heads, as Ulysses takes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from dcparallel.adapters import hf_attention as attention
from dcparallel.adapters.base import ModelAdapter, derive_spec, random_tokens
from dcparallel.adapters.hf_attention import hf_attention  # noqa: F401  (the function transformers calls)
from dcparallel.adapters.hf_structure import document_limit, ffn_size, resolve, set_block_attention
from dcparallel.spec import ModelSpec


def matches(model: nn.Module) -> bool:
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


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


def _config_int(cfg: Any, *names: str) -> int | None:
    for n in names:
        value = getattr(cfg, n, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def adapter(
    model: nn.Module,
    *,
    layers=None,
    num_heads=None,
    num_kv_heads=None,
    loss_fn=None,
    sample_fn=None,
    name: str | None = None,
    attn_modules=None,
    mlp_modules=None,
    **unused: Any,
) -> ModelAdapter:
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
    check_given_heads(num_heads, num_kv_heads, own_heads, own_kv, config="config", source="model.config")
    heads, kv = own_heads, own_kv
    qk_dim, v_dim = _head_dims(cfg)
    spec = causal_lm_spec(
        model,
        blocks,
        cfg,
        attn_of,
        mlp_of,
        name=name,
        heads=heads,
        kv=kv,
        head_dim=qk_dim,
        v_head_dim=v_dim if v_dim != qk_dim else 0,
    )
    return ModelAdapter(
        name=spec.name,
        kind="text",
        blocks=blocks,
        num_heads=heads,
        num_kv_heads=kv,
        install_attention=attention_installer(model, blocks, attn_of),
        spec=spec,
        attn_modules=attn_of,
        mlp_modules=mlp_of,
        loss_fn=loss_fn or hf_lm_loss,
        sample=sample_fn or random_tokens(cfg.vocab_size),
        collate="text",
    )


def check_given_heads(
    num_heads: int | None, num_kv_heads: int | None, heads: int, kv: int, *, config: str, source: str
) -> None:
    """Refuses ``num_heads`` / ``num_kv_heads`` other than the model's own ``heads`` / ``kv``,
    read from its ``config`` (the attribute path ``source``)."""
    for what, given, own in (("num_heads", num_heads, heads), ("num_kv_heads", num_kv_heads, kv)):
        if given is not None and given != own:
            raise ValueError(
                f"{what}={given} but the model's {config} has {own}; leave {what} out (it is read from {source})"
            )


def causal_lm_spec(
    model: nn.Module,
    blocks: list[nn.Module],
    cfg: Any,
    attn_of: Any,
    mlp_of: Any,
    *,
    name: str | None,
    heads: int,
    kv: int,
    head_dim: int,
    **extra: Any,
) -> ModelSpec:
    """The planner's `ModelSpec` of a transformers causal LM whose (text) config is ``cfg``:
    causal attention of ``heads`` query and ``kv`` key/value heads of ``head_dim`` (the spec
    records those that differ from a plain multi-head layer), the feed-forward size its
    blocks have, ``extra`` fields as given."""
    hidden = cfg.hidden_size
    return derive_spec(
        model,
        blocks,
        name=name or f"{model.config.model_type}-h{hidden}-l{len(blocks)}",
        kind="text",
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=ffn_size(cfg, blocks, hidden),
        attention="causal",
        attn_modules=attn_of,
        mlp_modules=mlp_of,
        vocab_size=cfg.vocab_size,
        num_kv_heads=kv if kv != heads else 0,
        head_dim=head_dim if head_dim * heads != hidden else 0,
        **extra,
    )


def attention_installer(model: nn.Module, blocks: list[nn.Module], attn_of: Any) -> Callable[[Any], None]:
    """`ModelAdapter.install_attention` of a transformers model (the language model of a
    VLM): registers dcparallel's attention function, gives each block's attention modules the
    runtime's attention with their document limits (read now), and switches the model to it."""
    limits = {id(m): document_limit(model, i, m) for i, b in enumerate(blocks) for m in attn_of(b)}

    def install(fn: Any) -> None:
        attention.register()
        set_block_attention(fn, blocks, attn_of, limits)
        model.set_attn_implementation(attention.NAME)

    return install
