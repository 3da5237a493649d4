"""diffusers models dcparallel has no adapter for: refused at construction, saying which class,
what is missing and what to do.

dcparallel shards a diffusers transformer's tokens where the model's context-parallel plan
(``_cp_plan``) says (`adapters.cp_plan`) and runs its attention through an attention
processor that knows the model's layout (self-attention over the sharded tokens, cross- or
joint attention to the text whole on every rank). A model without a plan has no declared
place to cut its sequence; a model with a plan still needs its processors written and
checked against the unmodified model (a parity test) before dcparallel drives it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: the diffusers transformers dcparallel drives, and their adapter modules
SUPPORTED = (
    "WanTransformer3DModel and ChronoEditTransformer3DModel (adapters.wan), SkyReelsV2Transformer3DModel, "
    "WanVACETransformer3DModel and HeliosTransformer3DModel (adapters.wan_variants), "
    "LTXVideoTransformer3DModel (adapters.ltx), FluxTransformer2DModel (adapters.flux), "
    "Flux2Transformer2DModel (adapters.flux2), QwenImageTransformer2DModel (adapters.qwenimage), and with "
    "joint video + text attention HunyuanVideoTransformer3DModel, CogVideoXTransformer3DModel, "
    "MochiTransformer3DModel (adapters.joint)"
)

#: models with a plan whose layout needs more than the plan: what exactly is missing
MISSING = {
    "LTX2VideoTransformer3DModel": (
        "its _cp_plan shards only the video tokens, but every block also runs an audio stream "
        "(audio_hidden_states: audio_attn1, audio_attn2, audio_ff) and attends across the streams: "
        "video_to_audio_attn takes the audio as queries over the video's keys and values, which inside an SP "
        "group are sharded, and its cross-modal rotary tables (ca_video_rotary_emb) are outside the plan; "
        "dcparallel has no processor that gathers the video keys for those audio queries, and no default loss "
        "for the second target (the audio output, audio_proj_out); the video-only LTX-Video "
        "(LTXVideoTransformer3DModel) trains"
    ),
}


def matches(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.")


def _processors(model: nn.Module) -> list[str]:
    procs = getattr(model, "attn_processors", None)
    if not isinstance(procs, dict):
        return []
    return sorted({type(p).__name__ for p in procs.values()})


def adapter(model: nn.Module, **unused: Any):
    who = type(model).__name__
    fix = (
        "pass adapter=dcparallel.adapters.ModelAdapter(...) built for it (install_attention for its attention "
        "processors, install_hooks that shard and gather its tokens, loss_fn, sample), or train one of: " + SUPPORTED
    )
    if not getattr(model, "_cp_plan", None):
        raise ValueError(
            f"dcparallel cannot drive the diffusers model {who}: it has no context-parallel plan "
            f"(_cp_plan, which dcparallel applies with its own hooks), so there is no declared place to "
            f"split and gather its token sequence, and its attention is not a joint video + text layout "
            f"dcparallel implements. To train it, {fix}"
        )
    if who in MISSING:
        raise ValueError(f"dcparallel cannot drive the diffusers model {who} yet: {MISSING[who]}. To train it, {fix}")
    procs = ", ".join(_processors(model)) or "unknown"
    raise ValueError(
        f"dcparallel cannot drive the diffusers model {who} yet: it has a context-parallel plan "
        f"(_cp_plan), but dcparallel has no parity-tested attention processor for its attention layout "
        f"(processors: {procs}), so Ulysses cannot be installed in it. To train it, {fix}"
    )
