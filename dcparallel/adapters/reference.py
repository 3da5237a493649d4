"""Adapters of the reference models (`models.llama.Llama`, `models.dit.DiT`): ordinary users
of the model protocol (`set_attention`, ``layers`` with ``attn_block`` / ``mlp_block``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters.base import ModelAdapter, positional_lm_loss, protocol_adapter
from dcparallel.models.dit import DiT, draw_flow, flow_matching_loss
from dcparallel.models.llama import Llama
from dcparallel.spec import Size


def matches(model: nn.Module) -> bool:
    return isinstance(model, (Llama, DiT))


def adapter(model: nn.Module, *, layers=None, num_heads=None, num_kv_heads=None, **kw: Any) -> ModelAdapter:
    c = model.cfg
    if isinstance(model, Llama):
        return protocol_adapter(
            model,
            layers=layers,
            num_heads=num_heads or c.num_heads,
            kind="text",
            attention="causal",
            hidden=c.hidden,
            ffn_hidden=c.ffn_hidden,
            loss_fn=kw.pop("loss_fn", None) or positional_lm_loss,
            name=kw.pop("name", None) or f"llama-h{c.hidden}-l{c.num_layers}",
            **kw,
        )
    pair = c.attention == "factorized"  # a spatial + temporal block pair is one planner layer
    return protocol_adapter(
        model,
        layers=layers,
        num_heads=num_heads or c.num_heads,
        kind="video",
        attention="factorized" if pair else "full",
        hidden=c.hidden,
        ffn_hidden=c.mlp_ratio * c.hidden,
        blocks_per_layer=2 if pair else 1,
        loss_fn=kw.pop("loss_fn", None) or dit_flow_loss,
        sample_fn=kw.pop("sample_fn", None) or dit_samples(model),
        name=kw.pop("name", None) or f"dit-h{c.hidden}-l{c.num_layers}",
        collate="video",
        **kw,
    )


def dit_flow_loss(model: DiT, batch: Any, ctx: Any) -> Tensor:
    """Flow matching on the reference DiT: each sample's timestep and noise come from its own
    generator (seed, epoch, sample id), so every rank of an SP group draws the same ones."""
    x = batch.inputs.to(next(model.parameters()).dtype)  # bf16 models take bf16 tokens; the loss is fp32
    draws = [draw_flow(ctx.generator(s), batch.seq_len, model.cfg.patch_dim, x.device) for s in batch.sample_ids]
    t = torch.stack([d[0] for d in draws]).to(x.device)
    noise = torch.stack([batch.shard_sample(d[1]) for d in draws]).to(device=x.device, dtype=x.dtype)
    ptl = flow_matching_loss(model, x, batch.positions, t, noise, batch.frames)
    return ctx.token_loss(ptl, batch.loss_mask)


def dit_samples(model: DiT, seed: int = 0):
    """Synthetic DiT items of a pixel size (frames, height, width): random patch tokens of the
    latent grid the planner's rule gives (`ModelSpec.latent_grid`: Open-Sora's 5/17 frames,
    16-pixel patches), as `collate_video` takes them."""
    patch_dim = model.cfg.patch_dim

    def sample(size: Size, index: int) -> dict:
        if not isinstance(size, tuple):
            raise ValueError(f"a video model takes (frames, height, width) sample sizes; got {size!r}")
        frames, height, width = size
        t = 1 if frames == 1 else max(1, frames * 5 // 17)
        nh, nw = math.ceil(height / 16), math.ceil(width / 16)
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(nh), torch.arange(nw), indexing="ij"), -1)
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return {
            "tokens": torch.randn(t * nh * nw, patch_dim, generator=g),
            "positions": grid.reshape(-1, 3),
            "frames": t,
        }

    return sample
