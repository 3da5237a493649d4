"""diffusers' `MochiTransformer3DModel`: every block runs one joint attention over video
tokens and the caption's real tokens (video and text with their own projections; the last
block keeps no text output), under Ulysses by `adapters.joint`.

diffusers' processor attends, per sample, over [video, the caption's real tokens] and
returns the text output compacted: the real tokens' outputs first (in order), zeros after.
`UlyssesMochiAttention` masks the padded caption keys instead and then compacts the text
output the same way, so the result is the same for any mask. Hooks cut the video tokens and
the rotary tables (N, heads, head_dim / 2) before the first block and gather before the output
norm; the caption embedding and the timestep run whole on every rank.

Dataset items: ``{"latents": (C, F, H, W), "encoder_hidden_states": (T, text_embed_dim)}``,
optional ``"encoder_attention_mask"`` (T,) (1 = real token; default all real). The default
loss is rectified flow with timestep 1000 t; Mochi's pipeline runs time the other way (its
scheduler inverts the sigmas) — pass ``loss_fn`` to fine-tune a released checkpoint in its
own convention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters import joint
from dcparallel.adapters.base import ModelAdapter, averaged_spec
from dcparallel.adapters.latents import RuntimeProcessor, extras_as, latent_flow_loss, padded_text_mask
from dcparallel.data.batch import Batch

BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "encoder_attention_mask", "image_rotary_emb")


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ == "MochiTransformer3DModel"


def _rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary on interleaved pairs (x[2i], x[2i+1]) with angles (N, heads, head_dim / 2)."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([(even * cos - odd * sin).to(x.dtype), (even * sin + odd * cos).to(x.dtype)], -1).flatten(-2)


def compact_text(out: Tensor, mask: Tensor) -> Tensor:
    """(B, T, ...) text outputs -> the real tokens' rows first, in order, then zero rows."""
    keep = mask.bool()
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    zeroed = torch.where(keep.view(*keep.shape, *([1] * (out.dim() - 2))), out, out.new_zeros(()))
    return zeroed.gather(1, order.view(*order.shape, *([1] * (out.dim() - 2))).expand_as(out))


class UlyssesMochiAttention(RuntimeProcessor):
    """Attention processor for Mochi's joint attention: diffusers' projections, norms and
    rotary, the joint attention of `adapters.joint` with the caption mask, the text output
    compacted as diffusers returns it."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor,
        attention_mask: Tensor,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ):
        heads = attn.heads
        split = lambda x: x.unflatten(2, (heads, -1))
        q, k, v, qt, kt, vt = joint.project_two_streams(attn, hidden_states, encoder_hidden_states, split)
        if image_rotary_emb is not None:
            q, k = _rotate_pairs(q, *image_rotary_emb), _rotate_pairs(k, *image_rotary_emb)
        mask = attention_mask.bool()
        out, out_text = joint.joint_attention(q, k, v, qt, kt, vt, mask, self.attention, text_first=False)
        return joint.project_out(attn, out.flatten(2, 3), compact_text(out_text, mask).flatten(2, 3))


def predict(model: nn.Module, xt: Tensor, t: Tensor, batch: Batch) -> Tensor:
    text = extras_as(batch, xt.dtype, "encoder_hidden_states", "encoder_attention_mask")["encoder_hidden_states"]
    return model(
        xt,
        encoder_hidden_states=text,
        timestep=t * 1000,
        encoder_attention_mask=joint.caption_mask(batch, text),
        return_dict=False,
    )[0]


def mochi_flow_loss(model: nn.Module, batch: Batch, ctx: Any) -> Tensor:
    """Rectified flow through `predict` (see the module docstring for Mochi's convention)."""
    return latent_flow_loss(model, batch, ctx, predict)


def item_parts(model: nn.Module, context_tokens: int):
    """Synthetic items: random latents, captions with the last quarter of the tokens padding."""
    cfg = model.config
    return lambda size: {
        "latents": (cfg.in_channels, *size),
        "encoder_hidden_states": (context_tokens, cfg.text_embed_dim),
        "encoder_attention_mask": padded_text_mask(context_tokens),
    }


def attn_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attn1]


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    return [m for m in (block.ff, block.ff_context) if m is not None]


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
    cfg = model.config
    blocks = list(model.transformer_blocks)
    heads = joint.check_driven(
        model, blocks, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, unused=unused
    )
    hidden = heads * cfg.attention_head_dim
    ffn = max(m.out_features for m in blocks[0].ff.modules() if isinstance(m, nn.Linear))
    spec = averaged_spec(
        model,
        blocks,
        attn_modules,
        mlp_modules,
        name=name or f"mochi-h{hidden}-l{len(blocks)}",
        kind="video",
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=ffn,
        attention="full",
        context_tokens=context_tokens,
        t_num=1,
        t_den=1,
        spatial_patch=cfg.patch_size,
    )

    return joint.video_adapter(
        model,
        blocks,
        spec,
        processor=UlyssesMochiAttention,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn or mochi_flow_loss,
        parts=item_parts(model, context_tokens),
        sample_fn=sample_fn,
        norm=model.norm_out,
        block_args=BLOCK_ARGS,
        patch=(1, cfg.patch_size, cfg.patch_size),
        required=("encoder_hidden_states",),
    )
