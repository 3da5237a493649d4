"""diffusers' `CogVideoXTransformer3DModel` (1.0 and 1.5, text-to-video): each block runs one
joint attention over [text tokens, video tokens] with shared projections, under Ulysses by
`adapters.joint`.

* the patch embedding (text projection, video patches, sinusoidal positions of 1.0) runs
  whole on every rank of the group; before the first block the video tokens are cut to this
  rank's shard, and every block's rotary tables (5B / 1.5 models) too;
* every block's attention runs through `UlyssesCogVideoXAttention` (diffusers'
  `set_processor` seam): diffusers' projections, q/k layer norms and rotary on this rank's
  video tokens, then `joint_attention`; the text stream stays whole on every rank;
* before the final norm: the video shards are gathered.

Dataset items: ``{"latents": (C, F, H, W), "encoder_hidden_states": (T, text_embed_dim)}`` —
latents as the VAE gives them; the loss hands the model (B, F, C, H, W) as it takes them.
The default loss is rectified flow, with the rotary tables diffusers' CogVideoX pipeline
builds for the latent size; CogVideoX was pretrained with v-prediction on a DDPM schedule, so
fine-tuning a released checkpoint wants its own objective: pass ``loss_fn``. Image-to-video
models (extra input channels, ``ofs`` embeddings) need ``loss_fn`` and ``sample_fn``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters import joint
from dcparallel.adapters.base import ModelAdapter, derive_spec
from dcparallel.adapters.latents import RuntimeProcessor, extras_as, latent_flow_loss
from dcparallel.data.batch import Batch

BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "attention_kwargs")


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ == "CogVideoXTransformer3DModel"


class UlyssesCogVideoXAttention(RuntimeProcessor):
    """Attention processor for CogVideoX's joint attention: diffusers' projections (also fused),
    q/k norms and rotary, the joint attention of `adapters.joint`."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ):
        from diffusers.models.embeddings import apply_rotary_emb

        if attention_mask is not None:
            raise ValueError(
                "CogVideoX joint attention with an attention_mask (passed through attention_kwargs) is "
                "not supported by dcparallel; leave the mask out (CogVideoX's text is not padded-out)"
            )
        t, heads = encoder_hidden_states.shape[1], attn.heads
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        q, k, v = (y.unflatten(2, (heads, -1)) for y in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        (qt, q), (kt, k), (vt, v) = ((y[:, :t], y[:, t:]) for y in (q, k, v))
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out, out_text = joint.joint_attention(q, k, v, qt, kt, vt, None, self.attention, text_first=True)
        both = torch.cat([out_text, out], dim=1).flatten(2, 3).to(q.dtype)
        both = attn.to_out[1](attn.to_out[0](both))
        return both[:, t:], both[:, :t]


def _crop_region(grid: tuple[int, int], base_w: int, base_h: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The region of the base grid (base_h x base_w) a latent grid (h, w) is resized into,
    centred, keeping its aspect ratio: CogVideoX 1.0's rotary crop coordinates."""
    h, w = grid
    if h / w > base_h / base_w:
        rh, rw = base_h, int(round(base_h / h * w))
    else:
        rw, rh = base_w, int(round(base_w / w * h))
    top, left = int(round((base_h - rh) / 2.0)), int(round((base_w - rw) / 2.0))
    return (top, left), (top + rh, left + rw)


def rotary_tables(model: nn.Module, frames: int, height: int, width: int, device=None) -> tuple[Tensor, Tensor] | None:
    """The (cos, sin) rotary tables (N, head_dim) of a latent (frames, height, width), as
    diffusers' CogVideoX pipeline builds them; None for models without rotary embeddings."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    cfg = model.config
    if not cfg.use_rotary_positional_embeddings:
        return None
    p, pt = cfg.patch_size, cfg.patch_size_t
    gh, gw = height // p, width // p
    bw, bh = cfg.sample_width // p, cfg.sample_height // p
    if pt is None:
        return get_3d_rotary_pos_embed(
            embed_dim=cfg.attention_head_dim,
            crops_coords=_crop_region((gh, gw), bw, bh),
            grid_size=(gh, gw),
            temporal_size=frames,
            device=device,
        )
    return get_3d_rotary_pos_embed(
        embed_dim=cfg.attention_head_dim,
        crops_coords=None,
        grid_size=(gh, gw),
        temporal_size=(frames + pt - 1) // pt,
        grid_type="slice",
        max_size=(bh, bw),
        device=device,
    )


def predict(model: nn.Module, xt: Tensor, t: Tensor, batch: Batch) -> Tensor:
    """CogVideoX's velocity for latents x_t (B, C, F, H, W) at timesteps t in [0, 1]."""
    _, _, f, h, w = xt.shape
    rotary = rotary_tables(model, f, h, w, device=xt.device)
    text = extras_as(batch, xt.dtype, "encoder_hidden_states")["encoder_hidden_states"]
    out = model(
        xt.transpose(1, 2), encoder_hidden_states=text, timestep=t * 1000, image_rotary_emb=rotary, return_dict=False
    )[0]
    return out.transpose(1, 2)


def cogvideox_flow_loss(model: nn.Module, batch: Batch, ctx: Any) -> Tensor:
    """Rectified flow through `predict` (see the module docstring for CogVideoX's own objective)."""
    return latent_flow_loss(model, batch, ctx, predict)


def item_parts(model: nn.Module, context_tokens: int):
    cfg = model.config
    return lambda size: {
        "latents": (cfg.in_channels, *size),
        "encoder_hidden_states": (context_tokens, cfg.text_embed_dim),
    }


def attn_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attn1]


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    return [block.ff]


def adapter(
    model: nn.Module,
    *,
    layers=None,
    num_heads=None,
    num_kv_heads=None,
    loss_fn=None,
    sample_fn=None,
    name: str | None = None,
    context_tokens: int | None = None,
    **unused: Any,
) -> ModelAdapter:
    who = type(model).__name__
    cfg = model.config
    if (cfg.in_channels != (cfg.out_channels or cfg.in_channels) or cfg.ofs_embed_dim) and not (loss_fn and sample_fn):
        raise ValueError(
            f"{who} with in_channels={cfg.in_channels}, out_channels={cfg.out_channels}, "
            f"ofs_embed_dim={cfg.ofs_embed_dim} is an image-to-video model: dcparallel's default loss and "
            f"samples know text-to-video only; pass loss_fn= and sample_fn= (image latents in the item)"
        )
    blocks = list(model.transformer_blocks)
    heads = joint.check_driven(
        model, blocks, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, unused=unused
    )
    # 1.0's sinusoidal positions cover exactly max_text_seq_length text tokens
    context_tokens = context_tokens or cfg.max_text_seq_length
    p, pt = cfg.patch_size, cfg.patch_size_t or 1
    hidden = heads * cfg.attention_head_dim
    ffn = max((m.out_features for m in blocks[0].ff.modules() if isinstance(m, nn.Linear)), default=4 * hidden)
    spec = derive_spec(
        model,
        blocks,
        name=name or f"cogvideox-h{hidden}-l{len(blocks)}",
        kind="video",
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=ffn,
        attention="full",
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        context_tokens=context_tokens,
        t_num=1,
        t_den=pt,
        spatial_patch=p,
    )

    return joint.video_adapter(
        model,
        blocks,
        spec,
        processor=UlyssesCogVideoXAttention,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn or cogvideox_flow_loss,
        parts=item_parts(model, context_tokens),
        sample_fn=sample_fn,
        norm=model.norm_final,
        block_args=BLOCK_ARGS,
        patch=(pt, p, p),
        required=("encoder_hidden_states",),
    )
