"""Runs step plans on torch.distributed: groups, collectives, Ulysses attention, the engine."""

from dcparallel.runtime.engine import Engine, MicroBatchContext
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.ulysses import UlyssesAttention, ulysses_attention
from dcparallel.runtime.zero import ZeroAdamW

__all__ = [
    "Engine",
    "MicroBatchContext",
    "ProcessGroups",
    "UlyssesAttention",
    "ZeroAdamW",
    "ulysses_attention",
]
