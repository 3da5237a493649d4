"""diffusers' `QwenImageTransformer2DModel` (Qwen-Image text-to-image) on images of many
resolutions and aspect ratios.

Every block is dual-stream: the image and the text are projected apart and attend jointly
over [text, image]; the text stream runs through every block. The model's ``_cp_plan``,
applied by dcparallel's hooks (`adapters.cp_plan`), cuts the image tokens at the first
block's input and the image rotary table (the rotary module's first output, over (frame,
row, column) of the packed latent) to this rank's shard, and gathers the output projection.
Kept whole on every rank: the text, its mask (``encoder_hidden_states_mask``) and the
text's rotary table (the rotary module's second output: positions after the image's
largest side, as the model computes them). The attention processor (`UlyssesQwenAttention`)
projects both streams (`joint.project_two_streams`), applies each stream's rotary table and
runs `joint.joint_attention`: only the image tokens travel, the text's heads are sliced from
the replicated text, padded image positions and masked text tokens are never attended, and
the text output is all-gathered over heads so the text stream stays whole and exact.

Sample sizes are latent shapes (1, height, width); latents (C, H, W) are packed 2 x 2 as
the Qwen-Image pipeline packs them, with ``img_shapes`` [(1, H/2, W/2)] per sample. Dataset
items: ``{"latents": (C, H, W), "encoder_hidden_states": (T, joint_attention_dim)}``, with an
optional ``encoder_hidden_states_mask`` (T,) (1 for text, 0 for padding; any pattern).

Refused by name: configurations whose image sequence holds more than the target image
(``zero_cond_t``: Qwen-Image-Edit's reference images; ``use_layer3d_rope`` /
``use_additional_t_cond``: Qwen-Image-Layered) and ControlNet residuals
(``controlnet_block_samples``, added to the whole image sequence after each block).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from dcparallel.adapters import joint
from dcparallel.adapters.base import ModelAdapter
from dcparallel.adapters.cp_plan import PlanHooks, read_plan
from dcparallel.adapters.flux import image_adapter, image_spec, packed_flow_loss
from dcparallel.adapters.latents import RuntimeProcessor, replace_processors

WHO = "QwenImageTransformer2DModel"


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ == WHO


class UlyssesQwenAttention(RuntimeProcessor):
    """Qwen-Image's joint attention under Ulysses (`joint.joint_attention`, text first)."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        encoder_hidden_states_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> tuple[Tensor, Tensor]:
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        if encoder_hidden_states is None:
            raise ValueError(f"{WHO}'s attention needs encoder_hidden_states (the text stream)")
        if attention_mask is not None:
            raise ValueError(
                f"{WHO}'s attention takes no attention_mask: pass encoder_hidden_states_mask, from which "
                f"it builds the joint mask"
            )
        head_dim = attn.inner_dim // attn.heads
        q, k, v, qt, kt, vt = joint.project_two_streams(
            attn, hidden_states, encoder_hidden_states, lambda x: x.unflatten(-1, (-1, head_dim))
        )
        if image_rotary_emb is not None:
            image, text = image_rotary_emb
            q, k = (apply_rotary_emb_qwen(x, image, use_real=False) for x in (q, k))
            qt, kt = (apply_rotary_emb_qwen(x, text, use_real=False) for x in (qt, kt))
        out_image, out_text = joint.joint_attention(
            q, k, v, qt, kt, vt, encoder_hidden_states_mask, self.attention, text_first=True
        )
        out_image, out_text = (x.flatten(2, 3).to(q.dtype) for x in (out_image, out_text))
        out_image = attn.to_out[0](out_image.contiguous())
        if len(attn.to_out) > 1:
            out_image = attn.to_out[1](out_image)
        return out_image, attn.to_add_out(out_text.contiguous())


def qwen_loss(channels: tuple[int, int] | None = None):
    """Qwen-Image's default loss (`flux.packed_flow_loss`): ``img_shapes`` [(1, H/2, W/2)] per
    sample, timesteps t in [0, 1] (the model scales them by 1000), the text mask if items carry one."""

    def forward(model: nn.Module, x: Tensor, t: Tensor, h: int, w: int, cond: dict[str, Tensor]) -> Tensor:
        return model(x, timestep=t, img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0], return_dict=False, **cond)[0]

    return packed_flow_loss(forward, ("encoder_hidden_states", "encoder_hidden_states_mask"), channels)


def refuse_controlnet(model: nn.Module):
    """A forward pre-hook refusing ControlNet residuals: the model adds them to the whole image
    sequence after each block, where inside an SP group each rank holds only its shard."""

    at = list(inspect.signature(type(model).forward).parameters)[1:].index("controlnet_block_samples")

    def hook(mod: nn.Module, args: tuple, kwargs: dict):
        if kwargs.get("controlnet_block_samples") is not None or (len(args) > at and args[at] is not None):
            raise ValueError(
                f"{WHO} got controlnet_block_samples: dcparallel's Qwen-Image adapter does not shard "
                f"ControlNet residuals (added to the whole image sequence after each block); train "
                f"without them or pass your own adapter"
            )
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def attn_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attn]


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    return [block.img_mlp, block.txt_mlp]


def refuse_more_than_the_target(cfg: Any) -> None:
    """Refuses configurations whose image sequence holds more than the target image."""
    odd = {k: getattr(cfg, k) for k in ("zero_cond_t", "use_layer3d_rope", "use_additional_t_cond") if getattr(cfg, k)}
    if odd:
        raise ValueError(
            f"{WHO} with {', '.join(f'{k}=True' for k in odd)}: these configurations (Qwen-Image-Edit "
            f"2511's reference images, Qwen-Image-Layered's layers) put more than the target image in "
            f"the image sequence, which dcparallel's Qwen-Image adapter does not shard or train; use a "
            f"text-to-image configuration or pass your own adapter"
        )


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
    **unused: Any,
) -> ModelAdapter:
    cfg = model.config
    refuse_more_than_the_target(cfg)
    blocks = list(model.transformer_blocks)
    heads = joint.check_driven(
        model, blocks, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, unused=unused
    )
    hidden = heads * cfg.attention_head_dim
    spec = image_spec(
        model,
        blocks,
        attn_modules,
        mlp_modules,
        name=name or f"qwenimage-h{hidden}-l{len(blocks)}",
        heads=heads,
        hidden=hidden,
        ffn_hidden=4 * hidden,
        context_tokens=context_tokens,
    )

    def install(fn: Any) -> None:
        replace_processors(
            [b.attn for b in blocks], "QwenDoubleStreamAttnProcessor2_0", lambda: UlyssesQwenAttention(fn), WHO
        )

    def install_hooks(attention: Any) -> list[Any]:
        plan = read_plan(model, replicated_outputs={("pos_embed", 1)})  # the text's rotary table stays whole
        return [*PlanHooks(model, plan, attention).install(), refuse_controlnet(model)]

    return image_adapter(
        model,
        blocks,
        spec,
        who=WHO,
        in_features=model.img_in.in_features,
        text_dim=cfg.joint_attention_dim,
        context_tokens=context_tokens,
        install=install,
        attn_modules=attn_modules,
        mlp_modules=mlp_modules,
        loss_fn=loss_fn,
        default_loss=qwen_loss,
        sample_fn=sample_fn,
        install_hooks=install_hooks,
    )
