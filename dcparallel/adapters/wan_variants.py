"""Wan look-alikes in diffusers, trained by Wan's adapter (`adapters.wan`) with what each
changes (a `wan.Variant`): the same patch embedding, rotary tables ``rope`` (cut after it),
blocks whose self-attention ``attn1`` runs Ulysses through `wan.UlyssesWanSelfAttention`,
cross-attention to the text (and image embeddings) whole on every rank, and the output
projection ``proj_out`` (gathered after it). Neither model declares a ``_cp_plan``; each is
driven by Wan's plan (`WAN_PLAN`, the cuts diffusers declares for `WanTransformer3DModel`)
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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dcparallel.adapters import wan
from dcparallel.adapters.base import ModelAdapter

CLASSES = ("SkyReelsV2Transformer3DModel", "WanVACETransformer3DModel")


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
    return wan.Variant(family="VACE", plan=vace_plan(), blocks=lambda model: [*model.vace_blocks, *model.blocks],
                       inputs=("control_hidden_states",), skip_block=vace_skip_block,
                       parts=lambda cfg, size: {"control_hidden_states": (cfg.vace_in_channels, *size)})


def skyreels_variant(cfg: Any) -> wan.Variant:
    fps = bool(cfg.inject_sample_info)
    return wan.Variant(family="SkyReelsV2", processor="SkyReelsV2AttnProcessor", plan=wan_plan(),
                       inputs=("fps",) if fps else (), parts=lambda cfg, size: {"fps": torch.tensor(1)} if fps else {})


def refuse_diffusion_forcing(model: nn.Module, attention: Any) -> Any:
    """A forward pre-hook refusing ``enable_diffusion_forcing=True`` inside an SP micro-batch:
    its per-frame modulation (B, 6, N, dim) reaches the blocks whole while their tokens are cut."""

    def hook(mod: nn.Module, args: tuple, kwargs: dict):
        a = attention.state()
        if kwargs.get("enable_diffusion_forcing") and a is not None and a.batch is not None and a.batch.sp > 1:
            raise ValueError(f"{type(mod).__name__} with enable_diffusion_forcing=True (per-frame timesteps) is not "
                             f"supported by dcparallel inside an SP group: its per-token modulation is not cut with "
                             f"the tokens; train with one timestep per sample (the default loss), or plan SP 1")
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def adapter(model: nn.Module, **kw: Any) -> ModelAdapter:
    who = type(model).__name__
    if who == "WanVACETransformer3DModel":
        return wan.adapter(model, variant=vace_variant(), **kw)
    cfg = model.config
    if cfg.num_frame_per_block > 1:
        raise ValueError(f"{who} with num_frame_per_block={cfg.num_frame_per_block} attends block-causally over "
                         f"frames (an (N, N) mask in every block), which dcparallel's Ulysses attention does not "
                         f"take; train it with num_frame_per_block=1 (full attention) or pass your own adapter")
    a = wan.adapter(model, variant=skyreels_variant(cfg), **kw)
    plan_hooks = a.install_hooks
    a.install_hooks = lambda attention: [*plan_hooks(attention), refuse_diffusion_forcing(model, attention)]
    return a
