"""Model adapters: how dcparallel drives a model (`ModelAdapter`), found by `find_adapter`
for the reference models, Hugging Face transformers causal LMs, the diffusers transformers
with a context-parallel plan it has adapters for (Wan, ChronoEdit, LTX-Video, Flux, Flux 2,
Qwen-Image) and the diffusers video transformers with joint video + text attention
(HunyuanVideo, CogVideoX, Mochi: `joint`); other diffusers models are refused with the
reason. Any other `nn.Module` follows `protocol_adapter`'s protocol. transformers and
diffusers are optional (`pip install dcparallel[hf]`, `[diffusers]`) and imported only for
their models."""

from dcparallel.adapters.base import (
    LossFn,
    ModelAdapter,
    SampleFn,
    derive_spec,
    positional_lm_loss,
    protocol_adapter,
)
from dcparallel.adapters.find import find_adapter

__all__ = [
    "LossFn",
    "ModelAdapter",
    "SampleFn",
    "derive_spec",
    "find_adapter",
    "positional_lm_loss",
    "protocol_adapter",
]
