"""diffusers' `Flux2Transformer2DModel` (Flux 2, Flux 2 Klein) on images of many resolutions and
aspect ratios, driven as Flux.1 is (`adapters.flux`): the model's ``_cp_plan`` shards the
image tokens and their 4-axis position ids at the model's input and gathers the output
projection; the text and its ids stay whole on every rank; every attention is joint over
[text, image] and exchanges only the image tokens (`flux.joint_attention`).

What differs from Flux.1, and how it is met:

* double-stream blocks (`Flux2Attention`) project text and image apart as Flux.1's do: the
  same processor (`flux.UlyssesFluxAttention`) with Flux 2's projections;
* single-stream blocks (`Flux2ParallelSelfAttention`) fuse the attention's q, k, v with the
  MLP's input projection and its output projection with the MLP's: `UlyssesFlux2SingleAttention`
  runs that fused layer around the joint attention. Recomputing such a block's attention or
  its MLP alone recomputes the fused layer (the one module holding both);
* position ids have four axes (t, h, w, l): the image's (0, row, column, 0), the text's
  (0, 0, 0, token index), passed (B, N, 4) as the pipelines pass them (the plan splits
  3-dimensional ids only);
* no pooled text. Guidance-distilled configurations (``guidance_embeds``) take a fixed
  ``guidance`` scale.

Refused by name: the reference-image KV cache (``kv_cache_mode``, ``num_ref_tokens``: its
reference tokens attend only to themselves, an attention dcparallel's processors do not
implement) and reference images appended to the image tokens (an item key the default loss
does not pass). Dataset items: ``{"latents": (C, H, W), "encoder_hidden_states": (T,
joint_attention_dim)}``, plus ``condition`` (C', H, W) where the model takes more input
channels than it predicts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters import joint
from dcparallel.adapters.base import ModelAdapter
from dcparallel.adapters.flux import (
    UlyssesFluxAttention,
    check_unit_patch,
    image_adapter,
    image_ids,
    image_spec,
    joint_attention,
    packed_flow_loss,
)
from dcparallel.adapters.latents import RuntimeProcessor, replace_processors

WHO = "Flux2Transformer2DModel"


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ == WHO


def refuse_kv_cache(kv_cache: Any, kv_cache_mode: Any, num_ref_tokens: int) -> None:
    if kv_cache is not None or kv_cache_mode is not None or num_ref_tokens:
        raise ValueError(
            f"{WHO} called with kv_cache_mode={kv_cache_mode!r}, num_ref_tokens={num_ref_tokens}: the "
            f"reference-image KV cache makes reference tokens attend only to themselves, which "
            f"dcparallel's Flux 2 attention does not implement; train without kv_cache_mode (an "
            f"inference feature) or pass your own adapter"
        )


def _projections(attn: nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None):
    from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

    return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)


class UlyssesFlux2Attention(UlyssesFluxAttention):
    """Flux 2's double-stream attention: Flux.1's processor with Flux 2's projections; the
    KV-cache keywords the model may pass are refused."""

    def __init__(self, attention: Any):
        super().__init__(attention, projections=_projections)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: Any = None,
        kv_cache: Any = None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
    ):
        refuse_kv_cache(kv_cache, kv_cache_mode, num_ref_tokens)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class UlyssesFlux2SingleAttention(RuntimeProcessor):
    """Flux 2's single-stream attention (``[text, image]`` rows, the MLP fused into the
    projections): diffusers' fused projection split into q, k, v and the MLP's input, q/k
    norms and rotary, `flux.joint_attention`, the MLP's activation, the fused output
    projection."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        image_rotary_emb: Any = None,
        kv_cache: Any = None,
        kv_cache_mode: str | None = None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
    ) -> Tensor:
        from diffusers.models.embeddings import apply_rotary_emb

        refuse_kv_cache(kv_cache, kv_cache_mode, num_ref_tokens)
        if attention_mask is not None:
            raise ValueError(
                f"dcparallel's {type(self).__name__} takes no attention_mask (Flux 2 attends over all "
                f"text tokens); leave it out of joint_attention_kwargs"
            )
        x = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = x.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = torch.split(x, [local_qkv, x.shape[-1] - local_qkv], dim=-1)
        q, k, v = (y.unflatten(-1, (-1, attn.head_dim)) for y in qkv.chunk(3, dim=-1))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = joint_attention(self.attention, q, k, v, None).flatten(2, 3).to(q.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def text_ids(num_tokens: int, device: Any = None) -> Tensor:
    """(T, 4) position ids of the text tokens: (0, 0, 0, index), as Flux 2's pipelines give."""
    ids = torch.zeros(num_tokens, 4, device=device)
    ids[:, 3] = torch.arange(num_tokens, device=device)
    return ids


def flux2_loss(guidance: float = 4.0, channels: tuple[int, int] | None = None):
    """Flux 2's default loss (`flux.packed_flow_loss`) with the pipelines' (B, N, 4) ids."""

    def forward(model: nn.Module, x: Tensor, t: Tensor, h: int, w: int, cond: dict[str, Tensor]) -> Tensor:
        text = cond["encoder_hidden_states"]
        b = x.shape[0]
        g = torch.full_like(t, guidance) if model.config.guidance_embeds else None
        return model(
            x,
            timestep=t,
            img_ids=image_ids(h, w, x.device, axes=4).expand(b, -1, -1),
            txt_ids=text_ids(text.shape[1], x.device).expand(b, -1, -1),
            guidance=g,
            return_dict=False,
            **cond,
        )[0]

    return packed_flow_loss(forward, ("encoder_hidden_states",), channels)


def attn_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attn]


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    """The MLP a recompute of it alone re-runs: a single-stream block's is fused into its attention."""
    return [block.ff, block.ff_context] if hasattr(block, "ff") else [block.attn]


def mlp_params_of(block: nn.Module) -> list[nn.Module]:
    """The MLP modules whose parameters the planner counts as MLP (a fused layer counts once, as attention)."""
    return [block.ff, block.ff_context] if hasattr(block, "ff") else []


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
    guidance: float = 4.0,
    **unused: Any,
) -> ModelAdapter:
    cfg = model.config
    check_unit_patch(WHO, "Flux 2", cfg.patch_size)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    heads = joint.check_driven(
        model, blocks, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, unused=unused, accepted=ACCEPTED
    )
    hidden = heads * cfg.attention_head_dim
    spec = image_spec(
        model,
        blocks,
        attn_modules,
        mlp_params_of,
        name=name or f"flux2-h{hidden}-l{len(blocks)}",
        heads=heads,
        hidden=hidden,
        ffn_hidden=int(hidden * cfg.mlp_ratio),
        context_tokens=context_tokens,
    )

    def install(fn: Any) -> None:
        replace_processors(
            [b.attn for b in model.transformer_blocks], "Flux2AttnProcessor", lambda: UlyssesFlux2Attention(fn), WHO
        )
        replace_processors(
            [b.attn for b in model.single_transformer_blocks],
            "Flux2ParallelSelfAttnProcessor",
            lambda: UlyssesFlux2SingleAttention(fn),
            WHO,
        )

    return image_adapter(
        model,
        blocks,
        spec,
        who=WHO,
        in_features=model.x_embedder.in_features,
        text_dim=cfg.joint_attention_dim,
        context_tokens=context_tokens,
        install=install,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn,
        default_loss=lambda channels: flux2_loss(guidance, channels),
        sample_fn=sample_fn,
    )
