"""diffusers' `HunyuanVideoTransformer3DModel` (text-to-video): dual-stream blocks (video and
text with their own weights, one joint attention) then single-stream blocks (video and text
through the same weights, one joint attention), under Ulysses by `adapters.joint`.

* before the blocks: the video hidden states and rotary tables are cut to this rank's shard
  (the text stream, the token refiner and the timestep / guidance / pooled-text embedding run
  whole on every rank of the group);
* every block's attention runs through `UlyssesHunyuanVideoAttention` (diffusers'
  `set_processor` seam): diffusers' projections, q/k RMS norms and rotary on this rank's video
  tokens, then `joint_attention` with the text padding mask the model builds from
  ``encoder_attention_mask``;
* before the output norm: the video shards are gathered.

Dataset items: ``{"latents": (C, F, H, W), "encoder_hidden_states": (T, text_embed_dim),
"pooled_projections": (pooled_projection_dim,)}``, optional ``"encoder_attention_mask"``
(T,) (1 = real token; default all real) and ``"guidance"`` (the guidance scale of a
guidance-distilled model: the model gets 1000 x it, as diffusers' pipeline passes it). Sample
sizes are latent (frames, height, width). Image-to-video variants (``image_condition_type``)
are refused: token replacement changes the first frame's modulation per token position.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters import joint
from dcparallel.adapters.base import ModelAdapter, averaged_spec
from dcparallel.adapters.latents import RuntimeProcessor, extras_as, latent_flow_loss, padded_text_mask
from dcparallel.data.batch import Batch

BLOCK_ARGS = (
    "hidden_states",
    "encoder_hidden_states",
    "temb",
    "attention_mask",
    "image_rotary_emb",
    "token_replace_emb",
    "first_frame_num_tokens",
)


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ == "HunyuanVideoTransformer3DModel"


class UlyssesHunyuanVideoAttention(RuntimeProcessor):
    """Attention processor for both of HunyuanVideo's block kinds: diffusers' projections,
    norms and rotary, the joint attention of `adapters.joint` (Ulysses on the video tokens
    inside a micro-batch, plain joint attention outside)."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ):
        from diffusers.models.embeddings import apply_rotary_emb

        if encoder_hidden_states is None:
            raise ValueError(
                "UlyssesHunyuanVideoAttention serves the joint video + text attention of "
                "HunyuanVideo's blocks; it got no text (encoder_hidden_states)"
            )
        heads, t = attn.heads, encoder_hidden_states.shape[1]
        split = lambda x: x.unflatten(2, (heads, -1))
        if attn.add_q_proj is None:  # single-stream: one set of projections over [video, text]
            x = torch.cat([hidden_states, encoder_hidden_states], dim=1)
            q, k, v = split(attn.to_q(x)), split(attn.to_k(x)), split(attn.to_v(x))
            if attn.norm_q is not None:
                q = attn.norm_q(q)
            if attn.norm_k is not None:
                k = attn.norm_k(k)
            (q, qt), (k, kt), (v, vt) = ((y[:, :-t], y[:, -t:]) for y in (q, k, v))
        else:  # dual-stream: the text has its own projections and norms
            q, k, v, qt, kt, vt = joint.project_two_streams(attn, hidden_states, encoder_hidden_states, split)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        text_mask = None
        if attention_mask is not None:  # (B, 1, 1, N + T): the model masks padded text keys only
            text_mask = attention_mask.reshape(attention_mask.shape[0], -1)[:, -t:].bool()
        out, out_text = joint.joint_attention(q, k, v, qt, kt, vt, text_mask, self.attention, text_first=False)
        return joint.project_out(attn, out.flatten(2, 3).to(q.dtype), out_text.flatten(2, 3).to(q.dtype))


def predict(model: nn.Module, xt: Tensor, t: Tensor, batch: Batch) -> Tensor:
    """HunyuanVideo's velocity for latents x_t at timesteps t in [0, 1] (diffusers scales by 1000)."""
    ex = extras_as(batch, xt.dtype, "encoder_hidden_states", "encoder_attention_mask", "pooled_projections", "guidance")
    text = ex["encoder_hidden_states"]
    guidance = None
    if model.config.guidance_embeds:
        if "guidance" not in ex:
            raise ValueError(
                f"{type(model).__name__} has guidance_embeds=True: give each sample a 'guidance' scale "
                f"(the model gets 1000 x it), or pass loss_fn"
            )
        guidance = ex["guidance"].to(xt.device).reshape(-1) * 1000.0
    elif "guidance" in ex:
        raise ValueError(
            f"{type(model).__name__} has guidance_embeds=False: it takes no 'guidance'; leave it out "
            f"of the items (or pass loss_fn)"
        )
    return model(
        xt,
        timestep=t * 1000,
        encoder_hidden_states=text,
        encoder_attention_mask=joint.caption_mask(batch, text),
        pooled_projections=ex["pooled_projections"],
        guidance=guidance,
        return_dict=False,
    )[0]


def hunyuan_flow_loss(model: nn.Module, batch: Batch, ctx: Any) -> Tensor:
    """Rectified flow (HunyuanVideo's own objective): `latents.latent_flow_loss` through `predict`."""
    return latent_flow_loss(model, batch, ctx, predict)


def item_parts(model: nn.Module, context_tokens: int):
    """Synthetic items: random latents, text embeddings with the last quarter of the tokens
    padding (masked), pooled text, guidance 6 where the model embeds guidance."""
    cfg = model.config

    def parts(size: tuple) -> dict:
        p = {
            "latents": (cfg.in_channels, *size),
            "encoder_hidden_states": (context_tokens, cfg.text_embed_dim),
            "encoder_attention_mask": padded_text_mask(context_tokens),
            "pooled_projections": (cfg.pooled_projection_dim,),
        }
        return p | ({"guidance": torch.tensor(6.0)} if cfg.guidance_embeds else {})

    return parts


def attn_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attn]


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    if hasattr(block, "ff"):  # dual-stream: video and text feed-forwards
        return [block.ff, block.ff_context]
    return [block.proj_mlp]  # single-stream: the MLP branch's input projection


def adapter(
    model: nn.Module,
    *,
    layers=None,
    num_heads=None,
    num_kv_heads=None,
    loss_fn=None,
    sample_fn=None,
    name: str | None = None,
    context_tokens: int = 256,
    **unused: Any,
) -> ModelAdapter:
    who = type(model).__name__
    cfg = model.config
    if cfg.image_condition_type is not None:
        raise ValueError(
            f"{who} with image_condition_type={cfg.image_condition_type!r} (image-to-video) is not "
            f"supported by dcparallel: its blocks modulate the first frame's tokens apart, by position; "
            f"use a text-to-video configuration (image_condition_type=None)"
        )
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    heads = joint.check_driven(
        model, blocks, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, unused=unused
    )
    hidden = heads * cfg.attention_head_dim
    spec = averaged_spec(
        model,
        blocks,
        attn_modules,
        mlp_modules,
        name=name or f"hunyuanvideo-h{hidden}-l{len(blocks)}",
        kind="video",
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=int(hidden * cfg.mlp_ratio),
        attention="full",
        context_tokens=context_tokens,
        t_num=1,
        t_den=cfg.patch_size_t,
        spatial_patch=cfg.patch_size,
    )

    return joint.video_adapter(
        model,
        blocks,
        spec,
        processor=UlyssesHunyuanVideoAttention,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn or hunyuan_flow_loss,
        parts=item_parts(model, context_tokens),
        sample_fn=sample_fn,
        norm=model.norm_out,
        block_args=BLOCK_ARGS,
        patch=(cfg.patch_size_t, cfg.patch_size, cfg.patch_size),
        required=("encoder_hidden_states", "pooled_projections"),
    )
