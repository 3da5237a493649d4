"""Runs step plans on torch.distributed: process groups, collectives, Ulysses attention and
the per-micro-batch engine."""

from dcparallel.runtime.engine import DataCentricParallel, MicroBatchContext, ZeroAdamW
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.ulysses import UlyssesAttention, ulysses_attention

__all__ = [
    "DataCentricParallel",
    "MicroBatchContext",
    "ProcessGroups",
    "UlyssesAttention",
    "ZeroAdamW",
    "ulysses_attention",
]
