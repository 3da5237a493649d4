"""diffusers' `FluxTransformer2DModel` (Flux.1) on images of many resolutions and aspect
ratios: joint attention over text and image tokens in every block (double-stream blocks
project text and image apart, single-stream blocks carry them concatenated).

Every rank of an SP group loads the whole images; the model's context-parallel plan
(``_cp_plan``), applied by dcparallel's hooks (`adapters.cp_plan`), shards the image tokens
and their position ids at the model's input and gathers the output projection. The plan
also splits the text and its ids; dcparallel keeps the text whole on every rank, so each
rank holds [all T text tokens, its shard of the image tokens] and the rotary tables the
model computes from ``cat(txt_ids, img_ids)`` line up with them. `joint_attention`
exchanges only the image tokens: an all-to-all gives every rank the whole image for its
H/sp heads, the text's own heads are a slice of the replicated text, attention runs over
[text, image] (image padding masked), the image output returns by the inverse all-to-all
and the text output is all-gathered over heads (its backward sums the group's partial
gradients of the replicated text stream, as the engine's gather does for the output). Under
ring attention the image tokens are the plan's zigzag columns and `joint.joint_attention`
attends them with the text over the ring (`runtime.ring_joint`); Ulysses then shards the
heads over the group's Ulysses degree only.

Sample sizes are latent shapes (1, height, width); the default loss packs latents (C, H, W)
into 2 x 2 patches the way diffusers' Flux pipeline does. Dataset items: ``{"latents":
(C, H, W), "encoder_hidden_states": (T, joint_attention_dim), "pooled_projections":
(pooled_projection_dim,)}``, plus ``condition`` (C', H, W) where the model takes more input
channels than it predicts (`latent_channels`). Guidance-distilled configurations
(``guidance_embeds``) take a fixed ``guidance`` scale.

The machinery every image transformer on packed latents shares lives here too (Flux 2:
`adapters.flux2`, Qwen-Image: `adapters.qwenimage`): packing, the target and condition
channels read from the model's projections, the collate, `packed_flow_loss`, into which a
family passes only how its pipeline calls the model, `image_spec`, their planner's spec,
`skip_block`, how the profiler skips any of their blocks, and `image_adapter`, the assembly
of their adapters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters import joint
from dcparallel.adapters.base import ModelAdapter, averaged_spec
from dcparallel.adapters.latents import (
    RuntimeProcessor,
    check_args,
    collate_latents,
    extras_as,
    latent_adapter,
    latent_flow_loss,
    random_items,
    replace_processors,
)
from dcparallel.data.batch import Batch
from dcparallel.models.attention import AttnPattern, default_kernel
from dcparallel.runtime.ulysses import check_heads
from dcparallel.spec import ModelSpec, Size

FULL = AttnPattern("full")


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ == "FluxTransformer2DModel"


def joint_attention(attention: Any, q: Tensor, k: Tensor, v: Tensor, num_text: int | None) -> Tensor:
    """q, k, v (B, T + L, H, D): T text tokens whole on every rank, then this rank's L
    image tokens (its shard of the padded image) -> (B, T + L, H, D), through the joint
    attention HunyuanVideo uses too (`joint.joint_attention`: only the image tokens travel,
    text heads sliced, padding masked). ``num_text`` None: the rest of the row after this
    rank's shard is text (single-stream blocks)."""
    active = joint.sharding(attention)
    if active is None:  # the whole row on this rank: plain attention over text and image
        kernel = attention.kernel or default_kernel(q.device)
        return kernel(q, k, v, FULL, None)
    _, batch = active
    check_heads(q.shape[2], batch.sp // batch.ring)  # Ulysses shards the heads; ring the blocks
    t = q.shape[1] - batch.shard_len if num_text is None else num_text
    if q.shape[1] != t + batch.shard_len:
        raise ValueError(
            f"joint attention got {q.shape[1]} tokens: {t} text + {q.shape[1] - t} image, but this "
            f"rank holds {batch.shard_len} image tokens"
        )
    image, text = zip(*((x[:, t:], x[:, :t]) for x in (q, k, v)), strict=True)
    out_image, out_text = joint.joint_attention(*image, *text, None, attention, text_first=True)
    return torch.cat([out_text, out_image], dim=1)


class UlyssesFluxAttention(RuntimeProcessor):
    """Attention processor for Flux's attention modules (double- and single-stream):
    diffusers' projections, q/k norms and rotary, then `joint_attention`."""

    def __init__(self, attention: Any, projections: Any = None):
        super().__init__(attention)
        self.projections = projections  # None: Flux.1's; Flux 2 passes its own module's

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: Any = None,
    ):
        from diffusers.models.embeddings import apply_rotary_emb

        if self.projections is None:
            from diffusers.models.transformers.transformer_flux import _get_qkv_projections as projections
        else:
            projections = self.projections
        if attention_mask is not None:
            raise ValueError(
                f"dcparallel's {type(self).__name__} takes no attention_mask (the model attends over "
                f"all text tokens); leave it out of joint_attention_kwargs"
            )
        q, k, v, eq, ek, ev = projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        num_text = None
        if attn.added_kv_proj_dim is not None:
            eq, ek, ev = (x.unflatten(-1, (-1, attn.head_dim)) for x in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1), torch.cat([ev, v], dim=1)
            num_text = eq.shape[1]
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = joint_attention(self.attention, q, k, v, num_text).flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        t = encoder_hidden_states.shape[1]
        text, image = out[:, :t], out[:, t:]
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


def pack(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), the Flux pipeline's 2 x 2 packing."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: Tensor, h: int, w: int) -> Tensor:
    b, _, d = x.shape
    return x.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, device: Any = None, axes: int = 3) -> Tensor:
    """(H/2 * W/2, axes) position ids of the packed tokens: row in axis 1, column in axis 2,
    the other axes 0 (Flux.1: (0, row, column); Flux 2: (0, row, column, 0))."""
    ids = torch.zeros(h // 2, w // 2, axes, device=device)
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, axes)


def latent_channels(who: str, in_features: int, out_features: int) -> tuple[int, int]:
    """(target channels, condition channels) of a model on 2 x 2-packed latents whose tokens
    have ``in_features`` (the input projection's) and ``out_features`` (the output
    projection's): the model predicts ``out_features / 4`` latent channels; input channels
    beyond those are conditioning concatenated to the noisy latents (an inpainting mask and
    masked image, say), which items carry as ``condition``."""
    if in_features % 4 or out_features % 4 or out_features > in_features:
        raise ValueError(
            f"{who} takes tokens of {in_features} features and predicts {out_features}: dcparallel's "
            f"default loss packs latents (C, H, W) into 2 x 2 patches (4 C features per token), the "
            f"target's channels first and condition channels after them, so both must be multiples of "
            f"4 with the input at least the output; pass loss_fn for another layout"
        )
    return out_features // 4, (in_features - out_features) // 4


def image_tokens(grid: tuple[int, ...]) -> int:
    """Tokens of a latent image (height, width) packed 2 x 2."""
    if len(grid) != 2 or grid[0] % 2 or grid[1] % 2:
        raise ValueError(
            f"image latents must be (C, height, width) with even height and width (2 x 2 packing); "
            f"got spatial shape {grid}: crop or pad the latents"
        )
    return (grid[0] // 2) * (grid[1] // 2)


def image_size(size: Size) -> tuple[int, int]:
    """(height, width) of a latent image's sample size (1, height, width)."""
    if not isinstance(size, tuple) or len(size) != 3 or size[0] != 1:
        raise ValueError(f"image models take latent sample sizes (1, height, width); got {size!r}")
    return size[1], size[2]


def collate_images(samples: Any, mb: Any, ranks: tuple[int, ...], rank: int) -> Batch:
    """The image families' collate: same-shape latents (C, H, W) and conditioning, whole."""
    return collate_latents(samples, mb, ranks, rank, tokens=image_tokens, what="image")


def packed_flow_loss(forward, names: tuple[str, ...], channels: tuple[int, int] | None = None):
    """Rectified flow on 2 x 2-packed latents: per-sample t and noise from the sample's
    generator, ``x_t = (1 - t) x0 + t noise`` (the items' condition channels appended after
    the noisy latents' own, as the pipelines concatenate them), packed; the model's packed
    prediction unpacked and compared with the velocity noise - x0, mean squared error over
    channels per latent pixel. ``forward(model, packed x_t, t, height, width, conditioning)``
    calls the model the way its pipeline does; ``names``: the item keys it passes;
    ``channels``: (target, condition) channels (`latent_channels`; None: the latents' own, no
    condition)."""
    target, condition_channels = channels or (None, 0)
    keys = (*names, "condition") if condition_channels else names

    def predict(model: nn.Module, xt: Tensor, t: Tensor, batch: Batch) -> Tensor:
        h, w = xt.shape[2:]
        if target is not None and xt.shape[1] != target:
            raise ValueError(
                f"{type(model).__name__} predicts {target} latent channels, but the items' latents have "
                f"{xt.shape[1]}: give 'latents' the target's channels only"
                + (f" and the other {condition_channels} input channels as 'condition'" if condition_channels else "")
            )
        cond = extras_as(batch, xt.dtype, *keys)
        if condition_channels:
            c = cond.pop("condition", None)
            if c is None or c.shape[1:] != (condition_channels, h, w):
                got = None if c is None else tuple(c.shape[1:])
                raise ValueError(
                    f"{type(model).__name__} takes {condition_channels} condition channels after the "
                    f"{xt.shape[1]} latent channels: items need 'condition' of shape "
                    f"{(condition_channels, h, w)}, got {got}"
                )
            xt = torch.cat([xt, c], dim=1)
        return unpack(forward(model, pack(xt), t, h, w, cond), h, w)

    def loss(model: nn.Module, batch: Batch, ctx: Any) -> Tensor:
        return latent_flow_loss(model, batch, ctx, predict)

    return loss


def flux_loss(guidance: float = 3.5, channels: tuple[int, int] | None = None):
    """Flux.1's default loss (`packed_flow_loss`): position ids (0, row, column) for the
    image, zeros for the text, pooled text, a fixed guidance scale where the model embeds one."""

    def forward(model: nn.Module, x: Tensor, t: Tensor, h: int, w: int, cond: dict[str, Tensor]) -> Tensor:
        text = cond["encoder_hidden_states"]
        g = torch.full_like(t, guidance) if model.config.guidance_embeds else None
        return model(
            x,
            timestep=t,
            img_ids=image_ids(h, w, x.device),
            txt_ids=text.new_zeros(text.shape[1], 3),
            guidance=g,
            return_dict=False,
            **cond,
        )[0]

    return packed_flow_loss(forward, ("encoder_hidden_states", "pooled_projections"), channels)


def skip_block(hidden_states: Tensor, encoder_hidden_states: Tensor | None = None, *args: Any, **kwargs: Any):
    """A block of Flux.1, Flux 2 or Qwen-Image skipped by the profiler: what it returns,
    unchanged. Double-stream blocks (and Flux.1's single-stream ones) take and return both
    streams, text first; Flux 2's single-stream blocks take no text and return the joint rows."""
    return hidden_states if encoder_hidden_states is None else (encoder_hidden_states, hidden_states)


def image_adapter(
    model: nn.Module,
    blocks: list[nn.Module],
    spec: ModelSpec,
    *,
    who: str,
    in_features: int,
    text_dim: int,
    context_tokens: int,
    install: Any,
    attn_modules: Any,
    mlp_modules: Any,
    loss_fn: Any,
    default_loss: Any,
    sample_fn: Any,
    install_hooks: Any = None,
    **fixed_parts: tuple[int, ...],
) -> ModelAdapter:
    """The `ModelAdapter` of an image transformer on 2 x 2-packed latents (Flux.1, Flux 2,
    Qwen-Image), from what its family module says: ``install`` (its attention processors),
    the `ModelSpec` ``spec`` (its heads), ``default_loss((target, condition channels))``
    unless ``loss_fn``, the input projection's ``in_features`` (with the output projection
    ``proj_out``: the channels, `latent_channels`), ``context_tokens`` text embeddings of
    ``text_dim`` per synthetic item (plus ``fixed_parts``: shapes the same at every size),
    ``install_hooks`` (None: the model's ``_cp_plan`` as it is); the profiler skips blocks
    with `skip_block`."""
    channels, condition = latent_channels(who, in_features, model.proj_out.out_features)

    def parts(size: Size) -> dict[str, tuple[int, ...]]:
        h, w = image_size(size)
        item = {"latents": (channels, h, w), "encoder_hidden_states": (context_tokens, text_dim), **fixed_parts}
        return item | ({"condition": (condition, h, w)} if condition else {})

    return latent_adapter(
        model,
        blocks,
        spec,
        install=install,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn or default_loss((channels, condition)),
        sample=sample_fn or random_items(parts),
        collate=collate_images,
        install_hooks=install_hooks,
        skip_block=skip_block,
    )


def check_unit_patch(who: str, family: str, patch_size: int) -> None:
    """Refuses a patch size the default loss does not pack: it packs 2 x 2 as the pipelines do."""
    if patch_size != 1:
        raise ValueError(
            f"{who} with patch_size={patch_size}: dcparallel's {family} loss packs latents into 2 x 2 "
            f"patches as the {family} pipelines do (patch_size 1); pass loss_fn for another layout"
        )


def image_spec(
    model: nn.Module,
    blocks: list[nn.Module],
    attn_modules: Any,
    mlp_modules: Any,
    *,
    name: str,
    heads: int,
    hidden: int,
    ffn_hidden: int,
    context_tokens: int,
) -> ModelSpec:
    """The planner's `ModelSpec` of an image transformer on 2 x 2-packed latents: full
    attention over one frame, its blocks' mean as the planner's layer (`averaged_spec`)."""
    return averaged_spec(
        model,
        blocks,
        attn_modules,
        mlp_modules,
        name=name,
        kind="video",
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=ffn_hidden,
        attention="full",
        context_tokens=context_tokens,
        t_num=1,
        t_den=1,
        spatial_patch=2,
    )


ACCEPTED = ("context_tokens", "guidance")


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
    guidance: float = 3.5,
    **unused: Any,
) -> ModelAdapter:
    check_args("diffusers FluxTransformer2DModel", unused, ACCEPTED)
    cfg = model.config
    check_unit_patch("FluxTransformer2DModel", "Flux", cfg.patch_size)
    blocks = list(layers) if layers is not None else [*model.transformer_blocks, *model.single_transformer_blocks]
    heads = num_heads or cfg.num_attention_heads
    hidden = heads * cfg.attention_head_dim
    attn_modules = lambda b: [b.attn]
    mlp_modules = lambda b: [b.ff, b.ff_context] if hasattr(b, "ff") else [b.proj_mlp]
    # double- and single-stream blocks differ: the planner's layer is their mean, the rest outside
    spec = image_spec(
        model,
        blocks,
        attn_modules,
        mlp_modules,
        name=name or f"flux-h{hidden}-l{len(blocks)}",
        heads=heads,
        hidden=hidden,
        ffn_hidden=4 * hidden,
        context_tokens=context_tokens,
    )

    def install(fn: Any) -> None:
        replace_processors(
            [b.attn for b in blocks], "FluxAttnProcessor", lambda: UlyssesFluxAttention(fn), "FluxTransformer2DModel"
        )

    return image_adapter(
        model,
        blocks,
        spec,
        who="FluxTransformer2DModel",
        in_features=model.x_embedder.in_features,
        text_dim=cfg.joint_attention_dim,
        context_tokens=context_tokens,
        install=install,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn,
        default_loss=lambda channels: flux_loss(guidance, channels),
        sample_fn=sample_fn,
        pooled_projections=(cfg.pooled_projection_dim,),
    )
