"""Wan look-alikes in diffusers, trained by Wan's adapter (`adapters.wan`) with what each
changes (a `wan.Variant`): the same patch embedding, rotary tables ``rope`` (cut after it),
blocks whose self-attention ``attn1`` runs Ulysses through `wan.UlyssesWanSelfAttention`,
cross-attention to the text (and image embeddings) whole on every rank, and the output
projection ``proj_out`` (gathered after it). SkyReels-V2 and VACE declare no ``_cp_plan``;
each is driven by Wan's (`wan_plan`, the cuts diffusers declares for `WanTransformer3DModel`)
plus its own entries.

* `SkyReelsV2Transformer3DModel` (SkyReels-V2 text-to-video; image-to-video with image
  embeddings and condition channels as Wan 2.1 I2V): blocks of five arguments (a causal
  mask last, None unless ``num_frame_per_block`` > 1), its own timestep sinusoids, and
  with ``inject_sample_info`` an fps embedding: item key ``fps`` (a long scalar, 0 or 1,
  the row of ``fps_embedding``; synthetic items take 1). Refused: block-causal attention
  (``num_frame_per_block`` > 1) and diffusion forcing (per-frame timesteps,
  ``enable_diffusion_forcing=True``), whose per-token modulation the plan does not cut.
* `WanVACETransformer3DModel` (VACE: Wan with control blocks): the control blocks
  (``vace_blocks``) run first, on the control latents (item key ``control_hidden_states``,
  (vace_in_channels, F, H, W)) embedded and added to the video tokens, and each leaves a
  hint added after one of Wan's blocks (``vace_layers``). The plan cuts the control block's
  video tokens and control tokens at the first control block (``vace_blocks.0``) as it cuts
  Wan's hidden states at ``blocks.0``, so every hint is this rank's tokens, added to this
  rank's tokens. The planner's layers are the control blocks then Wan's (control blocks
  carry two extra projections: per-layer parameters averaged, `base.averaged_spec`).
* `HeliosTransformer3DModel` (without history latents): its own plan's self-attention entries
  only (`helios_plan`): tokens and rotary tables cut at every ``attn1``, its output gathered,
  so the blocks' per-token modulation and current-token slices see the whole sequence;
  self-attention through `UlyssesHeliosSelfAttention`. History latents inside an SP group are
  refused (their tokens are prepended to the sequence the plan cuts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.adapters import wan
from dcparallel.adapters.base import ModelAdapter
from dcparallel.adapters.latents import RuntimeProcessor

CLASSES = ("SkyReelsV2Transformer3DModel", "WanVACETransformer3DModel", "HeliosTransformer3DModel")


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ in CLASSES


def wan_plan() -> dict:
    """diffusers' context-parallel plan of `WanTransformer3DModel` without its per-token
    timestep entry (neither look-alike takes (B, N) timesteps at its input)."""
    from diffusers import WanTransformer3DModel

    return {k: v for k, v in WanTransformer3DModel._cp_plan.items() if k != ""}


def vace_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput

    cut = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    return {**wan_plan(), "vace_blocks.0": {"hidden_states": cut, "control_hidden_states": cut}}


def vace_skip_block(*args: Any, **kwargs: Any) -> Any:
    """What a block the profiler's shallow stacks skip returns: a control block (it takes
    ``control_hidden_states``, its third argument) its control tokens as hint and state, one
    of Wan's blocks its hidden state."""
    control = args[2] if len(args) == 5 else kwargs.get("control_hidden_states")
    if control is not None:
        return control, control
    return args[0] if args else kwargs["hidden_states"]


def vace_variant() -> wan.Variant:
    return wan.Variant(
        family="VACE",
        plan=vace_plan(),
        blocks=lambda model: [*model.vace_blocks, *model.blocks],
        inputs=("control_hidden_states",),
        skip_block=vace_skip_block,
        parts=lambda cfg, size: {"control_hidden_states": (cfg.vace_in_channels, *size)},
    )


def skyreels_variant(cfg: Any) -> wan.Variant:
    fps = bool(cfg.inject_sample_info)
    return wan.Variant(
        family="SkyReelsV2",
        processor="SkyReelsV2AttnProcessor",
        plan=wan_plan(),
        inputs=("fps",) if fps else (),
        parts=lambda cfg, size: {"fps": torch.tensor(1)} if fps else {},
    )


class UlyssesHeliosSelfAttention(RuntimeProcessor):
    """Attention processor for a Helios self-attention module: diffusers' projections, q/k
    RMS norms, rotary and history-key scaling, the runtime's attention (Ulysses inside a
    micro-batch: this rank's tokens; plain full attention outside)."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        rotary_emb: Tensor | None = None,
        original_context_length: int | None = None,
    ) -> Tensor:
        from diffusers.models.transformers.transformer_helios import apply_rotary_emb_transposed

        q, k, v = wan.self_attention_qkv(
            attn, hidden_states, encoder_hidden_states, attention_mask, type(self).__name__
        )
        if rotary_emb is not None:
            q, k = apply_rotary_emb_transposed(q, rotary_emb), apply_rotary_emb_transposed(k, rotary_emb)
        history = hidden_states.shape[1] - (original_context_length or hidden_states.shape[1])
        if attn.is_amplify_history and history > 0:  # whole sequences only: history is refused inside SP
            scale = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
            if attn.history_scale_mode == "per_head":
                scale = scale.view(1, 1, -1, 1)
            k = torch.cat([k[:, :history] * scale, k[:, history:]], dim=1)
        out = self.attention(q, k, v, wan.FULL).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


HISTORY = ("latents_history_short", "latents_history_mid", "latents_history_long")


def helios_plan(model: nn.Module) -> dict:
    """diffusers' plan of `HeliosTransformer3DModel` for its self-attention only: the tokens
    and rotary tables cut at every ``attn1``'s input, its output gathered. Cross-attention and
    feed-forward are per token and run on the whole sequence, which every rank holds between
    the attentions (so the per-token modulation and the current-token slices the blocks take by
    count stay whole); the plan's entries for blocks the model does not have are left out."""
    n = len(model.blocks)
    keep = {}
    for key, entry in type(model)._cp_plan.items():
        parts = key.split(".")
        if parts[-1] == "attn1" and (parts[1] == "*" or int(parts[1]) < n):
            keep[key] = entry
    return keep


def refuse_inputs(model: nn.Module, attention: Any, refused: dict[str, str]) -> Any:
    """A forward pre-hook refusing, inside an SP micro-batch, the model inputs in ``refused``
    (name -> why) given a value that enables them."""

    def hook(mod: nn.Module, args: tuple, kwargs: dict):
        a = attention.state()
        if a is None or a.batch is None or a.batch.sp == 1:
            return None
        for name, why in refused.items():
            if kwargs.get(name) is not None and kwargs.get(name) is not False:
                raise ValueError(
                    f"{type(mod).__name__} with {name} is not supported by dcparallel inside an SP "
                    f"group: {why}; train without it, or plan SP 1"
                )
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def helios_variant(model: nn.Module) -> wan.Variant:
    return wan.Variant(
        family="Helios",
        processor="HeliosAttnProcessor",
        plan=helios_plan(model),
        self_attention=UlyssesHeliosSelfAttention,
    )


def adapter(model: nn.Module, **kw: Any) -> ModelAdapter:
    who = type(model).__name__
    if who == "WanVACETransformer3DModel":
        return wan.adapter(model, variant=vace_variant(), **kw)
    if who == "HeliosTransformer3DModel":
        a = wan.adapter(model, variant=helios_variant(model), **kw)
        plan_hooks = a.install_hooks
        why = "history tokens are prepended to the sequence the plan cuts by the current tokens' count"
        a.install_hooks = lambda attention: [
            *plan_hooks(attention),
            refuse_inputs(model, attention, dict.fromkeys(HISTORY, why)),
        ]
        return a
    cfg = model.config
    if cfg.num_frame_per_block > 1:
        raise ValueError(
            f"{who} with num_frame_per_block={cfg.num_frame_per_block} attends block-causally over "
            f"frames (an (N, N) mask in every block), which dcparallel's Ulysses attention does not "
            f"take; train it with num_frame_per_block=1 (full attention) or pass your own adapter"
        )
    a = wan.adapter(model, variant=skyreels_variant(cfg), **kw)
    plan_hooks = a.install_hooks
    why = "its per-frame modulation (B, 6, N, dim) reaches the blocks whole while their tokens are cut"
    a.install_hooks = lambda attention: [
        *plan_hooks(attention),
        refuse_inputs(model, attention, {"enable_diffusion_forcing": why}),
    ]
    return a
