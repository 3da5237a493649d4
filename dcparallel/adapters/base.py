"""`ModelAdapter`: how dcparallel drives one model, and the protocol any `nn.Module` can follow.

An adapter is a dataclass of plain values and functions (a registry entry, as torchtitan's
model specs are). It says:

* ``blocks``: the model's repeated blocks, in order; one planner layer (`ModelSpec`) is
  ``blocks_per_layer`` consecutive blocks (a spatial + temporal pair of a factorized DiT: 2);
* per block, the sub-modules that attention-only / MLP-only recomputation checkpoints
  (``attn_modules``, ``mlp_modules``; without them a block can only recompute whole);
* ``num_heads`` / ``num_kv_heads`` (grouped-query attention: fewer key/value heads);
* ``install_attention(fn)``: puts the runtime's attention function into the model (``fn(q,
  k, v, pattern)`` with q (B, L, H, D), k and v (B, L, H_kv, D) -> (B, L, H, D));
* ``spec``: the planner's `ModelSpec`, with the model's exact parameter counts;
* ``loss_fn(model, batch, ctx)``: the default work of one micro-batch (forward, summed loss);
  the training loop and the profiler both run it (or the user's own function of that shape);
* ``sample(size, index)``: a synthetic dataset item of a sample size, for profiling, and
  ``collate``: the loader's collate for the model's items;
* ``shard_hooks``: for models that take whole samples (a diffusers video transformer takes
  dense latents), hooks that shard the token sequence inside the model (`install` returns
  their handles).

`find_adapter` recognises the reference models, Hugging Face transformers causal LMs and
diffusers transformers (Wan, ChronoEdit, LTX-Video, Flux, Flux 2, Qwen-Image:
`adapters.cp_plan`; HunyuanVideo, CogVideoX, Mochi: `adapters.joint`); any other module
follows the small protocol of `protocol_adapter` (``set_attention(fn)``, ``layers``,
``num_heads``) or passes an adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dcparallel.spec import STATIC_MODES, ModelSpec, Size

#: one micro-batch's work: (model, Batch, MicroBatchContext) -> the shard's summed loss
LossFn = Callable[[nn.Module, Any, Any], Tensor]
#: a synthetic dataset item: (sample size, index) -> what dataset[i] would return
SampleFn = Callable[[Size, int], Any]


def _no_modules(block: nn.Module) -> list[nn.Module]:
    return []


@dataclass(kw_only=True)
class ModelAdapter:
    """How dcparallel drives a model (see the module docstring for each field)."""

    name: str
    kind: Literal["text", "video"]
    blocks: Sequence[nn.Module]
    num_heads: int
    num_kv_heads: int
    install_attention: Callable[[Any], None]
    spec: ModelSpec
    blocks_per_layer: int = 1
    attn_modules: Callable[[nn.Module], list[nn.Module]] = _no_modules
    mlp_modules: Callable[[nn.Module], list[nn.Module]] = _no_modules
    loss_fn: LossFn | None = None
    sample: SampleFn | None = None
    collate: Any = "auto"
    """the loader's collate: "text", "video" (tokens stacked and sharded by the loader) or a
    function ``collate(samples_by_id, micro_batch, group_ranks, rank)``"""
    install_hooks: Callable[[Any], list[Any]] | None = None
    """``install_hooks(attention)`` -> hook handles: shards and gathers the token sequence
    inside a model that takes whole samples (``Batch.sharded`` is False for its batches)"""
    skip_block: Callable[..., Any] | None = None
    """what a block the profiler's shallow stacks skip returns, called with the block's
    arguments (None: its hidden state, the first argument or ``hidden_states=``; blocks that
    return several streams, e.g. (video, text), pass them all on)"""

    def __post_init__(self) -> None:
        self.blocks = list(self.blocks)
        if not self.blocks:
            raise ValueError(
                f"{self.name}: the model has no repeated blocks (layers); pass layers=[...] with its transformer blocks"
            )
        if self.blocks_per_layer < 1 or len(self.blocks) % self.blocks_per_layer:
            raise ValueError(
                f"{self.name}: {len(self.blocks)} blocks do not split into planner layers of "
                f"{self.blocks_per_layer}; pass blocks_per_layer dividing the number of blocks"
            )
        if self.spec.num_layers * self.blocks_per_layer != len(self.blocks):
            raise ValueError(
                f"{self.name}: the spec has {self.spec.num_layers} layers of {self.blocks_per_layer} "
                f"blocks, but the model has {len(self.blocks)} blocks"
            )
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: {self.num_heads} query heads and {self.num_kv_heads} key/value heads: "
                f"the key/value heads must divide the query heads"
            )

    def layer_of(self, block_index: int) -> int:
        """The planner layer (`Recompute` counts these) that block ``block_index`` belongs to."""
        return block_index // self.blocks_per_layer

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """The recompute modes this model supports: attention-/MLP-only need their sub-modules."""
        b = self.blocks[0]
        if self.attn_modules(b) and self.mlp_modules(b):
            return STATIC_MODES
        return ("none", "full")


# ---------------------------------------------------------------- the planner's view


def count_params(modules: Sequence[nn.Module], frozen: bool | None = None) -> int:
    """Parameters of the modules, each tensor once (shared or tied weights count once);
    ``frozen``: only those without (True) or with (False) ``requires_grad``."""
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            if frozen is None or frozen != p.requires_grad:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def derive_spec(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    name: str,
    kind: str,
    hidden: int,
    num_heads: int,
    ffn_hidden: int,
    attention: str,
    blocks_per_layer: int = 1,
    attn_modules: Callable[[nn.Module], list[nn.Module]] = _no_modules,
    mlp_modules: Callable[[nn.Module], list[nn.Module]] = _no_modules,
    **extra: Any,
) -> ModelSpec:
    """The planner's `ModelSpec` of a real model with its exact parameter counts: per planner
    layer (``blocks_per_layer`` consecutive blocks) the parameters of the attention and MLP
    sub-modules and the rest of the blocks; what is outside the blocks is ``extra_params``."""
    unit = list(blocks[:blocks_per_layer])
    attn = count_params([m for b in unit for m in attn_modules(b)])
    mlp = count_params([m for b in unit for m in mlp_modules(b)])
    other = count_params(unit) - attn - mlp
    num_layers = len(blocks) // blocks_per_layer
    total = count_params([model])
    bytes_per_value = next(model.parameters()).element_size()
    spec = ModelSpec(
        name=name,
        kind=kind,
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        ffn_hidden=ffn_hidden,
        attention=attention,
        attn_params=attn,
        mlp_params=mlp,
        other_params=other,
        extra_params=total - num_layers * (attn + mlp + other),
        attn_per_layer=blocks_per_layer,
        bytes_per_value=bytes_per_value,
        frozen_params=count_params([model], frozen=True),
        **extra,
    )
    assert spec.num_params == total, (spec.num_params, total)
    return spec


def averaged_spec(model: nn.Module, blocks: Sequence[nn.Module], attn_modules, mlp_modules, **fields: Any):
    """The planner's `ModelSpec` of a model whose blocks differ in size (HunyuanVideo's dual-
    and single-stream blocks): per layer the blocks' mean attention / MLP / other parameters
    (the planner sees uniform layers), the rest, rounding included, as ``extra_params`` — so
    the total is the model's exact parameter count; the largest block's parameters are what a
    parameter-shard block gathers at once (``max_unit_params``)."""
    n = len(blocks)
    attn = sum(count_params(attn_modules(b)) for b in blocks) // n
    mlp = sum(count_params(mlp_modules(b)) for b in blocks) // n
    other = sum(count_params([b]) for b in blocks) // n - attn - mlp
    total = count_params([model])
    spec = ModelSpec(
        num_layers=n,
        attn_params=attn,
        mlp_params=mlp,
        other_params=other,
        extra_params=total - n * (attn + mlp + other),
        max_unit_params=max(count_params([b]) for b in blocks),
        bytes_per_value=next(model.parameters()).element_size(),
        frozen_params=count_params([model], frozen=True),
        **fields,
    )
    assert spec.num_params == total, (spec.num_params, total)
    return spec


def embedding_vocab(model: nn.Module) -> int:
    """The vocabulary of a text model: rows of its first `nn.Embedding`."""
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.Embedding to read the vocabulary from; pass "
            f"sample_fn= (a synthetic dataset item per size) to profile it"
        )
    return emb.num_embeddings


def random_tokens(vocab: int, seed: int = 0) -> SampleFn:
    """Synthetic text items: ``size`` random token ids (a 1-D tensor), fixed per index."""

    def sample(size: Size, index: int) -> Tensor:
        if isinstance(size, tuple):
            raise ValueError(f"a text model takes token counts as sample sizes; got the video size {size}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return torch.randint(0, vocab, (int(size),), generator=g)

    return sample


#: model-protocol arguments that only some families take, and which
FAMILY_ARGS = {
    "context_tokens": "diffusers video/image transformers (Wan, LTX-Video, Flux, Flux 2, Qwen-Image)",
    "image_tokens": "diffusers WanTransformer3DModel (image-to-video)",
    "rope_interpolation_scale": "diffusers LTXVideoTransformer3DModel",
    "guidance": "diffusers FluxTransformer2DModel and Flux2Transformer2DModel",
}


def protocol_adapter(
    model: nn.Module,
    *,
    layers: Sequence[nn.Module] | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    kind: str = "text",
    attention: str | None = None,
    hidden: int | None = None,
    ffn_hidden: int | None = None,
    blocks_per_layer: int = 1,
    loss_fn: LossFn | None = None,
    sample_fn: SampleFn | None = None,
    collate: Any = "auto",
    name: str | None = None,
    **family_args: Any,
) -> ModelAdapter:
    """Any `nn.Module` that follows the small protocol:

    * ``model.set_attention(fn)`` installs the attention function every block calls as
      ``fn(q, k, v, pattern)`` (`dcparallel.models.attention`: q (B, L, H, D), k, v
      (B, L, H_kv, D); ``pattern`` an `AttnPattern`: causal text, full or factorized video);
    * ``layers`` (or ``model.layers``): the repeated blocks, each called with the hidden state
      as its first argument and returning the new hidden state; a block with ``attn_block``
      and ``mlp_block`` sub-modules can recompute either alone;
    * ``num_heads`` (and ``num_kv_heads`` if fewer, for grouped-query attention);
    * text models are called ``model(batch.inputs, batch.positions)`` and return logits, video
      models take the loader's stacked tokens — or pass ``loss_fn(model, batch, ctx)``;
    * profiling makes synthetic items: random tokens from the model's vocabulary (text), or
      pass ``sample_fn(size, index)``.
    """
    who = type(model).__name__
    _refuse_family_args(who, family_args)
    layers, num_heads = _protocol_parts(model, who, layers, num_heads, kind)
    blocks = list(layers)
    kv = num_kv_heads or num_heads
    hidden = hidden or getattr(getattr(model, "cfg", None), "hidden", 0) or _guess_hidden(blocks[0])
    attention = attention or ("causal" if kind == "text" else "full")
    extra: dict[str, Any] = {}
    if kind == "text":
        loss_fn, sample_fn, extra["vocab_size"] = _text_defaults(model, loss_fn, sample_fn)
    spec = derive_spec(
        model,
        blocks,
        name=name or f"{who.lower()}-l{len(blocks)}",
        kind=kind,
        hidden=hidden,
        num_heads=num_heads,
        ffn_hidden=ffn_hidden or 4 * hidden,
        attention=attention,
        blocks_per_layer=blocks_per_layer,
        attn_modules=_protocol_attn_modules,
        mlp_modules=_protocol_mlp_modules,
        num_kv_heads=kv if kv != num_heads else 0,
        **extra,
    )
    return ModelAdapter(
        name=spec.name,
        kind=kind,
        blocks=blocks,
        num_heads=num_heads,
        num_kv_heads=kv,
        install_attention=model.set_attention,
        spec=spec,
        blocks_per_layer=blocks_per_layer,
        attn_modules=_protocol_attn_modules,
        mlp_modules=_protocol_mlp_modules,
        loss_fn=loss_fn,
        sample=sample_fn,
        collate=collate,
    )


def _refuse_family_args(who: str, family_args: dict[str, Any]) -> None:
    """Refuses the model-protocol arguments of a family adapter, naming the family that takes each."""
    if family_args:
        meant = {k: FAMILY_ARGS.get(k, "no adapter of dcparallel") for k in sorted(family_args)}
        raise ValueError(
            f"{who} follows dcparallel's model protocol, which takes no "
            + ", ".join(f"{k}= (an argument of {v})" for k, v in meant.items())
            + "; leave it out, or give the protocol's own arguments (layers, num_heads, num_kv_heads, "
            "kind, attention, hidden, ffn_hidden, blocks_per_layer, loss_fn, sample_fn, collate, name)"
        )


def _protocol_parts(
    model: nn.Module, who: str, layers: Sequence[nn.Module] | None, num_heads: int | None, kind: str
) -> tuple[Sequence[nn.Module], int]:
    """(blocks, attention heads) of a model following the protocol, given or read from the
    model (``model.layers``, ``model.cfg.num_heads``); everything the protocol lacks is
    refused in one message."""
    missing = []
    if not hasattr(model, "set_attention"):
        missing.append(
            "set_attention(fn): a method that installs the attention function every block calls "
            "(see dcparallel.models.attention.AttentionFn)"
        )
    if layers is None:
        layers = getattr(model, "layers", None)
        if layers is None:
            missing.append(
                "layers: pass layers=[...] (the repeated transformer blocks) or give the model a .layers ModuleList"
            )
    own_heads = getattr(getattr(model, "cfg", None), "num_heads", None)
    if num_heads is not None and own_heads is not None and num_heads != own_heads:
        raise ValueError(
            f"num_heads={num_heads} but {who} has {own_heads} attention heads (model.cfg.num_heads); "
            f"leave num_heads out or pass the model's own"
        )
    if num_heads is None:
        num_heads = own_heads
        if num_heads is None:
            missing.append("num_heads: pass num_heads= (the attention heads; SP degrees must divide them)")
    if kind not in ("text", "video"):
        missing.append(f"kind: 'text' or 'video' (got {kind!r})")
    if missing:
        raise ValueError(
            f"dcparallel cannot drive {who}: it is not a reference, Hugging Face or diffusers model, "
            f"and it lacks what the model protocol needs:\n  - "
            + "\n  - ".join(missing)
            + "\nOr pass adapter=dcparallel.adapters.ModelAdapter(...) built for it."
        )
    return layers, num_heads


def _text_defaults(
    model: nn.Module, loss_fn: LossFn | None, sample_fn: SampleFn | None
) -> tuple[LossFn, SampleFn, int]:
    """A text model's loss (`positional_lm_loss` unless given), synthetic items (random tokens
    of its vocabulary unless given) and vocabulary (0 with the user's ``sample_fn``: not read)."""
    vocab = embedding_vocab(model) if sample_fn is None else 0
    return positional_lm_loss if loss_fn is None else loss_fn, sample_fn or random_tokens(vocab), vocab


def _split_block(b: nn.Module) -> bool:
    """Whether a protocol block can recompute its attention or its MLP alone."""
    return hasattr(b, "attn_block") and hasattr(b, "mlp_block")


def _protocol_attn_modules(b: nn.Module) -> list[nn.Module]:
    return [b.attn_block] if _split_block(b) else []


def _protocol_mlp_modules(b: nn.Module) -> list[nn.Module]:
    return [b.mlp_block] if _split_block(b) else []


def _guess_hidden(block: nn.Module) -> int:
    lin = next((m for m in block.modules() if isinstance(m, nn.Linear)), None)
    return lin.in_features if lin is not None else 0


def positional_lm_loss(model: nn.Module, batch: Any, ctx: Any) -> Tensor:
    """The protocol's text step: ``model(inputs, positions)`` -> logits; summed next-token loss."""
    return ctx.lm_loss(model(batch.inputs, batch.positions))
