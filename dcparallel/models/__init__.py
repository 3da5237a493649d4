"""Reference single-device models. No torch.distributed, no dcparallel.runtime: attention
is the function each model is given."""

from dcparallel.models.attention import AttentionFn, AttnPattern, sdpa_attention
from dcparallel.models.dit import DiT, DiTConfig
from dcparallel.models.llama import Llama, LlamaConfig

__all__ = ["AttentionFn", "AttnPattern", "DiT", "DiTConfig", "Llama", "LlamaConfig", "sdpa_attention"]
