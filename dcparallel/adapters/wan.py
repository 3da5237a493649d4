"""diffusers' `WanTransformer3DModel` (Wan 2.1 / 2.2 text-to-video): full 3D self-attention
over frames x height x width patches, cross-attention to text embeddings.

The model takes whole latents (B, C, F, H, W) and patchifies them itself, so every rank of
an SP group loads the whole samples (``Batch.sharded`` is False) and the token sequence is
sharded inside the model, through module hooks (nothing of diffusers is patched):

* before each block: whatever of the hidden states (B, N, C), the rotary tables (1, N, 1, D)
  and per-token timestep embeddings (Wan 2.2 TI2V) is still whole is padded to the batch's
  ``padded_len`` and cut to this rank's ``shard_len`` tokens;
* each block's self-attention (``attn1``) runs through `UlyssesWanSelfAttention`, an
  attention processor (diffusers' supported seam, `set_processor`): projections, q/k RMS
  norms and rotary per token, then the runtime's Ulysses attention over the whole sequence;
  cross-attention (``attn2``) keeps diffusers' processor: its queries are this rank's tokens,
  its keys the replicated text, so it needs no communication;
* before the output norm: the shards are all-gathered (padding dropped), and the output
  layer and unpatchify run on the whole sequence on every rank of the group; the loss
  helper `MicroBatchContext.dense_loss` counts each position 1/sp times per rank, so the
  group counts it once and the gather's backward (an all-reduce) gives exact gradients.

Sample sizes are latent shapes (frames, height, width) — the VAE's output, before the
transformer's (1, 2, 2) patches — and a micro-batch holds samples of one shape (stacked).
Dataset items are ``{"latents": (C, F, H, W), "encoder_hidden_states": (T, text_dim)}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters.base import ModelAdapter, derive_spec
from dcparallel.data.batch import Batch
from dcparallel.models.attention import AttnPattern
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime import comm
from dcparallel.spec import Size

FULL = AttnPattern("full")


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ == "WanTransformer3DModel"


def _rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on interleaved pairs (x[2i], x[2i+1]) of the head dim, the layout of
    diffusers' Wan tables (each pair's angle stored twice)."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)


class UlyssesWanSelfAttention:
    """Attention processor for a Wan self-attention module: the same projections, q/k norms
    and rotary as diffusers' processor, with the runtime's attention (Ulysses inside a
    micro-batch, plain full attention outside)."""

    def __init__(self, attention: Any):
        self.attention = attention

    def __call__(self, attn: nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, rotary_emb: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("UlyssesWanSelfAttention serves self-attention without a mask only (attn1)")
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _rotate_pairs(q, *rotary_emb), _rotate_pairs(k, *rotary_emb)
        out = self.attention(q, k, v, FULL).flatten(2, 3).type_as(q)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def _shard(x: Tensor, batch: Batch, dim: int = 1) -> Tensor:
    """This rank's ``shard_len`` positions along ``dim`` of the padded sequence."""
    pad = batch.padded_len - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    return x.narrow(dim, batch.shard_start, batch.shard_len)


def _sharding(attention: Any) -> tuple[Any, Batch] | None:
    a = attention.state()
    if a is None or a.batch is None or a.batch.sharded or comm.group_size(a.group) == 1:
        return None
    return a.group, a.batch


def install_hooks(model: nn.Module, attention: Any) -> list[Any]:
    def shard_inputs(block: nn.Module, args: tuple, kwargs: dict):
        # every block gets the model's whole rotary tables (and per-token timestep embeddings);
        # the first block also the whole hidden states: cut whatever is still whole
        active = _sharding(attention)
        if active is None:
            return None
        _, batch = active
        cut = lambda x: _shard(x, batch) if x.shape[1] == batch.seq_len else x
        hidden, context, temb, rotary = args
        if temb.ndim == 4:  # per-token timestep embeddings (Wan 2.2 TI2V): (B, N, 6, C)
            temb = cut(temb)
        return (cut(hidden), context, temb, tuple(cut(r) for r in rotary)), kwargs

    def gather_outputs(norm: nn.Module, args: tuple):
        active = _sharding(attention)
        if active is None:
            return None
        group, batch = active
        return (comm.gather_seq(args[0], group, dim=1)[:, : batch.seq_len],)

    return [*(b.register_forward_pre_hook(shard_inputs, with_kwargs=True) for b in model.blocks),
            model.norm_out.register_forward_pre_hook(gather_outputs)]


# ---------------------------------------------------------------- data


def collate_latents(samples: Mapping[int, Any], mb: MicroBatch, ranks: tuple[int, ...], rank: int, *,
                    patch: tuple[int, int, int]) -> Batch:
    """Stacks same-shape latents (and their text embeddings) whole on every rank of the group;
    the model shards the tokens itself."""
    ranks = tuple(ranks)
    if rank not in ranks or mb.layout.sp != len(ranks):
        raise ValueError(f"rank {rank} / group {ranks} does not run micro-batch {mb.sample_ids} (sp={mb.layout.sp})")
    lat, ctx = [], []
    for sid in mb.sample_ids:
        s = samples[sid]
        if not isinstance(s, Mapping) or "latents" not in s:
            raise ValueError(f"video sample {sid} must be a mapping with 'latents' (C, frames, height, width) and "
                             f"'encoder_hidden_states' (text tokens, text_dim); got {type(s).__name__}")
        lat.append(torch.as_tensor(s["latents"]))
        if s.get("encoder_hidden_states") is not None:
            ctx.append(torch.as_tensor(s["encoder_hidden_states"]))
    shapes = {tuple(x.shape) for x in lat}
    if len(shapes) != 1 or any(x.dim() != 4 for x in lat):
        raise ValueError(f"samples {mb.sample_ids} of one micro-batch must be latents of one shape (C, F, H, W); got "
                         f"{sorted(shapes)}")
    if ctx and (len(ctx) != len(lat) or len({tuple(c.shape) for c in ctx}) != 1):
        raise ValueError(f"samples {mb.sample_ids}: give every sample encoder_hidden_states of one shape")
    c, f, h, w = lat[0].shape
    pt, ph, pw = patch
    if f % pt or h % ph or w % pw:
        raise ValueError(f"latent shape {(f, h, w)} is not divisible by the patch {patch}; crop or pad the latents")
    n = (f // pt) * (h // ph) * (w // pw)
    sp = len(ranks)
    b = len(lat)
    return Batch(sample_ids=tuple(mb.sample_ids), layout=mb.layout, ranks=ranks, rank_in_group=ranks.index(rank),
                 inputs=torch.stack(lat), positions=torch.zeros(b, 0, dtype=torch.long), labels=None,
                 loss_mask=torch.ones(b, f, h, w, dtype=torch.bool),
                 token_sample=torch.arange(b)[:, None, None, None].expand(b, f, h, w),
                 num_targets=(f * h * w,) * b, cu_seqlens=(0, n), seq_len=n, padded_len=-(-n // sp) * sp,
                 frames=f // pt, sharded=False,
                 extras={"encoder_hidden_states": torch.stack(ctx)} if ctx else {})


def wan_flow_loss(model: nn.Module, batch: Batch, ctx: Any) -> Tensor:
    """Rectified-flow training of Wan: per sample a timestep t (logit-normal) and noise from
    its own generator; x_t = (1 - t) x0 + t noise, target velocity noise - x0, mean squared
    error over channels per latent position."""
    dtype = next(model.parameters()).dtype  # bf16 models take bf16 latents; the loss is fp32
    x0 = batch.inputs.to(dtype)
    ts, noises = [], []
    for sid in batch.sample_ids:
        g = ctx.generator(sid)
        ts.append(torch.sigmoid(torch.randn((), generator=g)))
        noises.append(torch.randn(x0.shape[1:], generator=g))
    t = torch.stack(ts).to(device=x0.device, dtype=torch.float32)
    noise = torch.stack(noises).to(device=x0.device, dtype=x0.dtype)
    tb = t.to(x0.dtype).view(-1, 1, 1, 1, 1)
    xt = (1 - tb) * x0 + tb * noise
    pred = model(xt, timestep=t * 1000, encoder_hidden_states=batch.extras["encoder_hidden_states"].to(dtype),
                 return_dict=False)[0]
    return ctx.dense_loss((pred.float() - (noise - x0).float()).pow(2).mean(1))


def latent_samples(model: nn.Module, context_tokens: int, seed: int = 0):
    cfg = model.config

    def sample(size: Size, index: int) -> dict:
        if not isinstance(size, tuple):
            raise ValueError(f"a video model takes latent (frames, height, width) sample sizes; got {size!r}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return {"latents": torch.randn(cfg.in_channels, *size, generator=g),
                "encoder_hidden_states": torch.randn(context_tokens, cfg.text_dim, generator=g)}

    return sample


def adapter(model: nn.Module, *, layers=None, num_heads=None, num_kv_heads=None, loss_fn=None, sample_fn=None,
            name: str | None = None, context_tokens: int = 512, **unused: Any) -> ModelAdapter:
    if unused:
        raise ValueError(f"unexpected arguments for a diffusers Wan model: {sorted(unused)}")
    cfg = model.config
    if cfg.added_kv_proj_dim is not None or cfg.image_dim is not None:
        raise ValueError("image-conditioned Wan (I2V: added_kv_proj_dim / image_dim) is not supported yet; use a "
                         "text-to-video configuration")
    blocks = list(layers) if layers is not None else list(model.blocks)
    heads = num_heads or cfg.num_attention_heads
    pt, ph, pw = cfg.patch_size
    if ph != pw:
        raise ValueError(f"patch {cfg.patch_size}: dcparallel's size rule needs square spatial patches")
    attn_modules = lambda b: [b.attn1, b.attn2]
    mlp_modules = lambda b: [b.ffn]
    spec = derive_spec(model, blocks, name=name or f"wan-h{heads * cfg.attention_head_dim}-l{len(blocks)}",
                       kind="video", hidden=heads * cfg.attention_head_dim, num_heads=heads, ffn_hidden=cfg.ffn_dim,
                       attention="full", attn_modules=attn_modules, mlp_modules=mlp_modules,
                       context_tokens=context_tokens, t_num=1, t_den=pt, spatial_patch=ph)

    def install(fn: Any) -> None:
        for b in blocks:
            b.attn1.set_processor(UlyssesWanSelfAttention(fn))

    def collate(samples, mb, ranks, rank):
        return collate_latents(samples, mb, ranks, rank, patch=(pt, ph, pw))

    return ModelAdapter(name=spec.name, kind="video", blocks=blocks, num_heads=heads, num_kv_heads=heads,
                        install_attention=install, spec=spec, attn_modules=attn_modules, mlp_modules=mlp_modules,
                        loss_fn=loss_fn or wan_flow_loss, sample=sample_fn or latent_samples(model, context_tokens),
                        collate=collate, install_hooks=lambda attention: install_hooks(model, attention))

