"""diffusers' `LTXVideoTransformer3DModel` (LTX-Video): full 3D self-attention over the
patch tokens of a video, cross-attention to text embeddings with a padding mask.

The model takes packed latents (B, N, C x patch) plus the latent grid (frames, height,
width); the default loss packs whole latents (C, F, H, W) the way diffusers' LTX pipeline
does and unpacks the prediction. Every rank of an SP group loads the whole samples and the
model's own context-parallel plan (``_cp_plan``), applied by dcparallel's hooks
(`adapters.cp_plan`), shards the tokens: hidden states at the model's input, the rotary
tables after ``rope``, the output projection gathered. The plan also splits the text and
its mask; dcparallel keeps both whole on every rank, so cross-attention (``attn2``,
diffusers' processor: this rank's queries against the whole masked text) needs no exchange.
Self-attention (``attn1``) runs through `UlyssesLTXSelfAttention`: projections, q/k RMS
norms and rotary per token, then the runtime's Ulysses attention.

Sample sizes are latent shapes (frames, height, width). Dataset items:
``{"latents": (C, F, H, W), "encoder_hidden_states": (T, caption_channels),
"encoder_attention_mask": (T,)}`` (the mask optional: 1 = a real text token).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from dcparallel.adapters.base import ModelAdapter, derive_spec
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
from dcparallel.spec import Size

FULL = AttnPattern("full")
#: the rotary scale diffusers' LTX-Video pipeline passes at 25 frames per second (VAE 8x temporal, 32x spatial)
PIPELINE_ROPE_SCALE = (8 / 25, 32, 32)


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ == "LTXVideoTransformer3DModel"


class UlyssesLTXSelfAttention(RuntimeProcessor):
    """Attention processor for an LTX self-attention module: diffusers' projections, q/k
    norms and rotary, with the runtime's attention (Ulysses inside a micro-batch)."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("UlyssesLTXSelfAttention serves self-attention without a mask only (attn1)")
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q, k = apply_rotary_emb(q, image_rotary_emb), apply_rotary_emb(k, image_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        out = self.attention(q, k, v, FULL).flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def pack(x: Tensor, p: int, pt: int) -> Tensor:
    """(B, C, F, H, W) -> (B, F/pt * H/p * W/p, C * pt * p * p), the LTX pipeline's order."""
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack(x: Tensor, grid: tuple[int, int, int], p: int, pt: int) -> Tensor:
    """`pack`'s inverse: (B, N, C * pt * p * p) -> (B, C, F, H, W)."""
    f, h, w = grid
    b = x.shape[0]
    x = x.reshape(b, f // pt, h // p, w // p, -1, pt, p, p)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, -1, f, h, w)


def ltx_loss(rope_scale: Any = PIPELINE_ROPE_SCALE):
    def predict(model: nn.Module, xt: Tensor, t: Tensor, batch: Batch) -> Tensor:
        cfg = model.config
        p, pt = cfg.patch_size, cfg.patch_size_t
        grid = tuple(xt.shape[2:])
        cond = extras_as(batch, xt.dtype, "encoder_hidden_states", "encoder_attention_mask")
        pred = model(
            pack(xt, p, pt),
            timestep=t * 1000,
            num_frames=grid[0] // pt,
            height=grid[1] // p,
            width=grid[2] // p,
            rope_interpolation_scale=rope_scale,
            return_dict=False,
            encoder_attention_mask=cond.pop("encoder_attention_mask", None),
            **cond,
        )[0]
        return unpack(pred, grid, p, pt)

    def loss(model: nn.Module, batch: Batch, ctx: Any) -> Tensor:
        """Rectified flow on LTX-Video (`latents.latent_flow_loss`): packed noisy latents in,
        the velocity unpacked out."""
        return latent_flow_loss(model, batch, ctx, predict)

    return loss


def attn_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attn1, block.attn2]


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    return [block.ff]


def check_channels(cfg: Any) -> None:
    """Refuses a model predicting other channels than it takes: the default loss's target is its input."""
    if (cfg.out_channels or cfg.in_channels) != cfg.in_channels:
        raise ValueError(
            f"LTXVideoTransformer3DModel with in_channels={cfg.in_channels} and out_channels="
            f"{cfg.out_channels}: dcparallel's loss needs equal channels; pass loss_fn"
        )


ACCEPTED = ("context_tokens", "rope_interpolation_scale")


def adapter(
    model: nn.Module,
    *,
    layers=None,
    num_heads=None,
    num_kv_heads=None,
    loss_fn=None,
    sample_fn=None,
    name: str | None = None,
    context_tokens: int = 128,
    rope_interpolation_scale: Any = PIPELINE_ROPE_SCALE,
    **unused: Any,
) -> ModelAdapter:
    check_args("diffusers LTXVideoTransformer3DModel", unused, ACCEPTED)
    cfg = model.config
    blocks = list(layers) if layers is not None else list(model.transformer_blocks)
    heads = num_heads or cfg.num_attention_heads
    p, pt = cfg.patch_size, cfg.patch_size_t
    check_channels(cfg)
    hidden = heads * cfg.attention_head_dim
    spec = derive_spec(
        model,
        blocks,
        name=name or f"ltx-h{hidden}-l{len(blocks)}",
        kind="video",
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=4 * hidden,
        attention="full",
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        context_tokens=context_tokens,
        t_num=1,
        t_den=pt,
        spatial_patch=p,
    )
    channels = cfg.in_channels // (p * p * pt)

    def parts(size: Size) -> dict[str, tuple[int, ...]]:
        return {"latents": (channels, *size), "encoder_hidden_states": (context_tokens, cfg.caption_channels)}

    def install(fn: Any) -> None:
        replace_processors(
            [b.attn1 for b in blocks],
            "LTXVideoAttnProcessor",
            lambda: UlyssesLTXSelfAttention(fn),
            "LTXVideoTransformer3DModel",
        )

    return latent_adapter(
        model,
        blocks,
        spec,
        install=install,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn or ltx_loss(rope_interpolation_scale),
        sample=sample_fn or random_items(parts),
        collate=patch_collate((pt, p, p)),
    )
