"""diffusers' `WanTransformer3DModel` in all its configurations (and ChronoEdit's
`ChronoEditTransformer3DModel`, Wan's image-to-video with other rotary tables): Wan 2.1 / 2.2 text-to-video,
image-to-video with image embeddings (Wan 2.1 I2V and FLF2V: ``image_dim`` /
``added_kv_proj_dim``), with condition channels (Wan 2.2 I2V: ``in_channels`` = latent +
condition channels), and per-token timesteps (Wan 2.2 TI2V, through the user's loss).

The model takes whole latents (B, C, F, H, W) and patchifies them itself, so every rank of
an SP group loads the whole samples (``Batch.sharded`` is False) and the token sequence is
sharded inside the model by the model's own context-parallel plan (``_cp_plan``), applied
by dcparallel's hooks (`adapters.cp_plan`): the rotary tables are cut after ``rope``, the
hidden states before the first block, per-token timesteps (B, N) at the model's input (so
their embeddings are computed for this rank's tokens only), and the output projection's
tokens gathered (padding dropped) before unpatchify. Attention:

* each block's self-attention (``attn1``) runs through `UlyssesWanSelfAttention`, an
  attention processor (diffusers' seam, `set_processor`): projections, q/k RMS norms and
  rotary per token, then the runtime's Ulysses attention over the whole sequence;
* cross-attention (``attn2``) keeps diffusers' processor: its queries are this rank's
  tokens, its keys the text (and image embeddings), whole on every rank — no exchange.

Sample sizes are latent shapes (frames, height, width) — the VAE's output, before the
transformer's (1, 2, 2) patches — and a micro-batch holds samples of one shape (stacked).
Dataset items: ``{"latents": (C_out, F, H, W), "encoder_hidden_states": (T, text_dim)}``
plus ``"encoder_hidden_states_image": (I, image_dim)`` when the model has ``image_dim``
and ``"condition": (C_in - C_out, F, H, W)`` when it has more input than output channels
(the default loss feeds ``cat([noisy latents, condition])`` and takes the output channels
as the target). diffusers' image-to-video processor takes the last 512 text tokens as text
and the rest as image tokens, so image-conditioned Wan needs 512 text tokens per sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters.base import ModelAdapter, averaged_spec, count_params, derive_spec
from dcparallel.adapters.cp_plan import read_plan
from dcparallel.adapters.latents import (
    RuntimeProcessor,
    check_args,
    extras_as,
    latent_adapter,
    latent_flow_loss,
    patch_collate,
    random_items,
    replace_processors,
)
from dcparallel.data.batch import Batch
from dcparallel.models.attention import AttnPattern
from dcparallel.spec import ModelSpec, Size

FULL = AttnPattern("full")


#: Wan's blocks, attention processors and forward; ChronoEdit differs in its rotary tables only
CLASSES = ("WanTransformer3DModel", "ChronoEditTransformer3DModel")


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ in CLASSES


def _rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on interleaved pairs (x[2i], x[2i+1]) of the head dim, the layout of
    diffusers' Wan tables (each pair's angle stored twice)."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)


def self_attention_qkv(
    attn: nn.Module,
    hidden_states: Tensor,
    encoder_hidden_states: Tensor | None,
    attention_mask: Tensor | None,
    who: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """A Wan-style self-attention's q, k, v (B, N, heads, head_dim): its (fused or separate)
    projections and q/k norms, as diffusers' processors compute them; a mask or a second
    stream is refused (these processors serve ``attn1`` only)."""
    if encoder_hidden_states is not None or attention_mask is not None:
        raise ValueError(f"{who} serves self-attention without a mask only (attn1)")
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    q, k = attn.norm_q(q), attn.norm_k(k)
    return tuple(t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))


class UlyssesWanSelfAttention(RuntimeProcessor):
    """Attention processor for a Wan self-attention module: the same projections, q/k norms
    and rotary as diffusers' processor, with the runtime's attention (Ulysses inside a
    micro-batch, plain full attention outside)."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        q, k, v = self_attention_qkv(attn, hidden_states, encoder_hidden_states, attention_mask, type(self).__name__)
        if rotary_emb is not None:
            q, k = _rotate_pairs(q, *rotary_emb), _rotate_pairs(k, *rotary_emb)
        out = self.attention(q, k, v, FULL).flatten(2, 3).type_as(q)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


@dataclass(frozen=True, kw_only=True)
class Variant:
    """What a Wan look-alike (same patch embedding, rotary tables, self- and cross-attention
    and output projection; `adapters.wan_variants`) changes in Wan's adapter."""

    family: str = "Wan"
    processor: str = "WanAttnProcessor"
    """diffusers' default processor of its attention modules (replaced in ``attn1``)"""
    plan: dict | None = None
    """its context-parallel plan in diffusers' format (None: the model's own ``_cp_plan``)"""
    blocks: Callable[[nn.Module], list[nn.Module]] = lambda model: list(model.blocks)
    """its transformer blocks in the order they run (each with ``attn1``, ``attn2``, ``ffn``)"""
    inputs: tuple[str, ...] = ()
    """item keys the default loss passes to the model by name, besides Wan's"""
    parts: Callable[[Any, Size], dict[str, tuple[int, ...] | Tensor]] = lambda cfg, size: {}
    """those items of a latent size, from the model's config: shapes (random in synthetic
    items) or values (`latents.random_items`)"""
    skip_block: Callable[..., Any] | None = None
    """`ModelAdapter.skip_block` (None: a block returns its hidden state)"""
    self_attention: Callable[[Any], Any] | None = None
    """the Ulysses processor of ``attn1`` made from the runtime's attention (None:
    `UlyssesWanSelfAttention`)"""


WAN = Variant()


def image_dim(cfg: Any) -> int | None:
    """The image embeddings' width of image-to-video models (None: text-to-video, or a
    look-alike without the field)."""
    return getattr(cfg, "image_dim", None)


#: what Wan's default loss passes to the model besides the latents and the timestep
WAN_INPUTS = ("encoder_hidden_states", "encoder_hidden_states_image")


def flow_loss(inputs: tuple[str, ...] = WAN_INPUTS):
    """Rectified-flow training of a Wan model: per sample a timestep t (logit-normal) and
    noise from its own generator; x_t = (1 - t) x0 + t noise (condition channels, if any,
    appended clean), target velocity noise - x0, mean squared error over the output channels
    per latent position; the items' ``inputs`` go to the model by name."""

    def predict(model: nn.Module, xt: Tensor, t: Tensor, batch: Batch) -> Tensor:
        cond = extras_as(batch, xt.dtype, "condition", *inputs)
        if "condition" in cond:
            xt = torch.cat([xt, cond.pop("condition")], dim=1)
        return model(xt, timestep=t * 1000, return_dict=False, **cond)[0]

    def wan_flow_loss(model: nn.Module, batch: Batch, ctx: Any) -> Tensor:
        cfg = model.config
        if batch.inputs.shape[1] != (cfg.out_channels or cfg.in_channels):
            raise ValueError(
                f"latents have {batch.inputs.shape[1]} channels but the model predicts "
                f"{cfg.out_channels}; give 'latents' the target channels (and extra input channels "
                f"as 'condition')"
            )
        return latent_flow_loss(model, batch, ctx, predict)

    return wan_flow_loss


wan_flow_loss = flow_loss()


def item_parts(model: nn.Module, context_tokens: int, image_tokens: int, variant: Variant = WAN):
    """The shape of each tensor of a Wan dataset item of a latent size."""
    cfg = model.config
    out = cfg.out_channels or cfg.in_channels

    def parts(size: Size) -> dict[str, tuple[int, ...]]:
        p = {"latents": (out, *size), "encoder_hidden_states": (context_tokens, cfg.text_dim)}
        if cfg.in_channels > out:
            p["condition"] = (cfg.in_channels - out, *size)
        if image_dim(cfg) is not None:
            p["encoder_hidden_states_image"] = (image_tokens, cfg.image_dim)
        return p | variant.parts(cfg, size)

    return parts


def latent_samples(
    model: nn.Module, context_tokens: int, seed: int = 0, image_tokens: int = 257, variant: Variant = WAN
):
    """Synthetic Wan items of a latent size, with the conditioning the model takes."""
    return random_items(item_parts(model, context_tokens, image_tokens, variant), seed)


def attn_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attn1, block.attn2]


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    return [block.ffn]


def check_config(who: str, cfg: Any, context_tokens: int) -> None:
    """Refuses what the default loss and diffusers' processors cannot train exactly: half of
    image-to-video's inputs, image-to-video without 512 text tokens, fewer input channels
    than output channels."""
    if (cfg.added_kv_proj_dim is None) != (image_dim(cfg) is None):
        raise ValueError(
            f"{who} with image_dim={image_dim(cfg)} and added_kv_proj_dim="
            f"{cfg.added_kv_proj_dim}: image-to-video needs both (image embeddings and their key/value "
            f"projections), text-to-video neither"
        )
    if image_dim(cfg) is not None and context_tokens != 512:
        raise ValueError(
            f"context_tokens={context_tokens}: diffusers' Wan image-to-video attention takes the last "
            f"512 text tokens as text and the rest as image tokens, so it needs 512 text tokens per "
            f"sample; pad or cut the text embeddings to 512 and pass context_tokens=512"
        )
    out_channels = cfg.out_channels or cfg.in_channels
    if cfg.in_channels < out_channels:
        raise ValueError(
            f"{who} with in_channels={cfg.in_channels} < out_channels={out_channels}: "
            f"dcparallel's loss takes the output channels as the target and extra input channels "
            f"as condition; pass loss_fn for another layout"
        )


def wan_spec(
    model: nn.Module, blocks: list[nn.Module], heads: int, *, name: str | None, family: str, context_tokens: int
) -> ModelSpec:
    """The planner's `ModelSpec` of a Wan model (``context_tokens``: text and image tokens
    each sample's cross-attention reads); blocks of different sizes (VACE: its control blocks
    carry projections of their own) are priced as their mean (`averaged_spec`)."""
    cfg = model.config
    pt, ph, pw = cfg.patch_size
    if ph != pw:
        raise ValueError(f"patch {cfg.patch_size}: dcparallel's size rule needs square spatial patches")
    hidden = heads * cfg.attention_head_dim
    fields = dict(
        name=name or f"{family.lower()}-h{hidden}-l{len(blocks)}",
        kind="video",
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=cfg.ffn_dim,
        attention="full",
        t_num=1,
        t_den=pt,
        spatial_patch=ph,
        context_tokens=context_tokens,
    )
    if len({count_params([b]) for b in blocks}) == 1:
        return derive_spec(model, blocks, attn_modules=attn_modules, mlp_modules=mlp_modules, **fields)
    return averaged_spec(model, blocks, attn_modules, mlp_modules, **fields)


ACCEPTED = ("context_tokens", "image_tokens")


def adapter(
    model: nn.Module,
    *,
    layers=None,
    num_heads=None,
    num_kv_heads=None,
    loss_fn=None,
    sample_fn=None,
    name: str | None = None,
    context_tokens: int = 512,
    image_tokens: int | None = None,
    variant: Variant = WAN,
    **unused: Any,
) -> ModelAdapter:
    who = type(model).__name__
    check_args(f"diffusers {who}", unused, ACCEPTED)
    cfg = model.config
    check_config(who, cfg, context_tokens)
    image_tokens = image_tokens or getattr(cfg, "pos_embed_seq_len", None) or 257
    blocks = list(layers) if layers is not None else variant.blocks(model)
    heads = num_heads or cfg.num_attention_heads
    spec = wan_spec(
        model,
        blocks,
        heads,
        name=name,
        family=variant.family,
        context_tokens=context_tokens + (image_tokens if image_dim(cfg) else 0),
    )
    cuts = read_plan(model, plan=variant.plan)

    def install(fn: Any) -> None:
        make = variant.self_attention or UlyssesWanSelfAttention
        replace_processors([b.attn1 for b in blocks], variant.processor, lambda: make(fn), who)

    return latent_adapter(
        model,
        blocks,
        spec,
        install=install,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn or flow_loss((*WAN_INPUTS, *variant.inputs)),
        sample=sample_fn or latent_samples(model, context_tokens, image_tokens=image_tokens, variant=variant),
        collate=patch_collate(tuple(cfg.patch_size)),
        plan=cuts,
        skip_block=variant.skip_block,
    )
