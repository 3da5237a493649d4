"""Runs step plans on torch.distributed: process groups, collectives, Ulysses attention and
the per-micro-batch engine."""

from dcparallel.runtime.engine import DataCentricParallel, MicroBatchContext, ZeroAdamW
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.shard import text_batch, video_batch
from dcparallel.runtime.ulysses import UlyssesAttention, ulysses_attention

__all__ = [
    "DataCentricParallel",
    "MicroBatchContext",
    "ProcessGroups",
    "UlyssesAttention",
    "ZeroAdamW",
    "text_batch",
    "ulysses_attention",
    "video_batch",
]
