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
from dcparallel.adapters.latents import latent_flow_loss
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


class UlyssesMochiAttention:
    """Attention processor for Mochi's joint attention: diffusers' projections, norms and
    rotary, the joint attention of `adapters.joint` with the caption mask, the text output
    compacted as diffusers returns it."""

    def __init__(self, attention: Any):
        self.attention = attention

    def __call__(self, attn: nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor,
                 attention_mask: Tensor, image_rotary_emb: tuple[Tensor, Tensor] | None = None):
        heads = attn.heads
        split = lambda x: x.unflatten(2, (heads, -1))
        q, k, v, qt, kt, vt = joint.project_two_streams(attn, hidden_states, encoder_hidden_states, split)
        if image_rotary_emb is not None:
            q, k = _rotate_pairs(q, *image_rotary_emb), _rotate_pairs(k, *image_rotary_emb)
        mask = attention_mask.bool()
        out, out_text = joint.joint_attention(q, k, v, qt, kt, vt, mask, self.attention, text_first=False)
        out, out_text = out.flatten(2, 3), compact_text(out_text, mask).flatten(2, 3)
        out = attn.to_out[1](attn.to_out[0](out))
        if hasattr(attn, "to_add_out"):
            out_text = attn.to_add_out(out_text)
        return out, out_text


def predict(model: nn.Module, xt: Tensor, t: Tensor, batch: Batch) -> Tensor:
    text = batch.extras["encoder_hidden_states"].to(xt.dtype)
    mask = batch.extras.get("encoder_attention_mask")
    mask = torch.ones(text.shape[:2], dtype=torch.long, device=xt.device) if mask is None else mask.to(xt.device)
    return model(xt, encoder_hidden_states=text, timestep=t * 1000, encoder_attention_mask=mask,
                 return_dict=False)[0]


def mochi_flow_loss(model: nn.Module, batch: Batch, ctx: Any) -> Tensor:
    """Rectified flow through `predict` (see the module docstring for Mochi's convention)."""
    return latent_flow_loss(model, batch, ctx, predict)


def latent_samples(model: nn.Module, context_tokens: int, seed: int = 0):
    """Synthetic items: random latents, captions with the last quarter of the tokens padding."""
    cfg = model.config

    def sample(size, index: int) -> dict:
        if not isinstance(size, tuple):
            raise ValueError(f"a video model takes latent (frames, height, width) sample sizes; got {size!r}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        mask = torch.ones(context_tokens, dtype=torch.long)
        mask[context_tokens - context_tokens // 4:] = 0
        return {"latents": torch.randn(cfg.in_channels, *size, generator=g),
                "encoder_hidden_states": torch.randn(context_tokens, cfg.text_embed_dim, generator=g),
                "encoder_attention_mask": mask}

    return sample


def attn_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attn1]


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    return [m for m in (block.ff, block.ff_context) if m is not None]


def adapter(model: nn.Module, *, layers=None, num_heads=None, num_kv_heads=None, loss_fn=None, sample_fn=None,
            name: str | None = None, context_tokens: int = 256, **unused: Any) -> ModelAdapter:
    who = type(model).__name__
    if unused:
        raise ValueError(f"unexpected arguments for diffusers {who}: {sorted(unused)}; it takes context_tokens=, "
                         f"loss_fn=, sample_fn=, name=")
    cfg = model.config
    blocks = list(model.transformer_blocks)
    if layers is not None and [id(b) for b in layers] != [id(b) for b in blocks]:
        raise ValueError(f"{who}: dcparallel drives all of its transformer_blocks itself; leave "
                         f"layers= out (or pass exactly those blocks)")
    heads = cfg.num_attention_heads
    if num_heads not in (None, heads) or num_kv_heads not in (None, heads):
        raise ValueError(f"{who} has {heads} attention heads (query and key/value); leave num_heads / num_kv_heads "
                         f"out or pass {heads}")
    hidden = heads * cfg.attention_head_dim
    ffn = max(m.out_features for m in blocks[0].ff.modules() if isinstance(m, nn.Linear))
    spec = averaged_spec(model, blocks, attn_modules, mlp_modules, name=name or f"mochi-h{hidden}-l{len(blocks)}",
                               kind="video", hidden=hidden, num_heads=heads, ffn_hidden=ffn, attention="full",
                               context_tokens=context_tokens, t_num=1, t_den=1, spatial_patch=cfg.patch_size)
    patch = (1, cfg.patch_size, cfg.patch_size)

    def install(fn: Any) -> None:
        for b in blocks:
            b.attn1.processor = UlyssesMochiAttention(fn)  # MochiAttention has no set_processor

    def collate(samples, mb, ranks, rank):
        return joint.collate_conditioned(samples, mb, ranks, rank, patch=patch, family=who,
                                         required=("encoder_hidden_states",), optional=("encoder_attention_mask",))

    def install_hooks(attention: Any) -> list[Any]:
        return [*joint.block_input_hooks(blocks, attention, names=BLOCK_ARGS, hidden="hidden_states",
                                         rotary="image_rotary_emb"),
                joint.gather_before(model.norm_out, attention)]

    return ModelAdapter(name=spec.name, kind="video", blocks=blocks, num_heads=heads, num_kv_heads=heads,
                        install_attention=install, spec=spec, attn_modules=attn_modules, mlp_modules=mlp_modules,
                        loss_fn=loss_fn or mochi_flow_loss, sample=sample_fn or latent_samples(model, context_tokens),
                        collate=collate, install_hooks=install_hooks,
                        skip_block=joint.two_stream_passthrough(BLOCK_ARGS))
