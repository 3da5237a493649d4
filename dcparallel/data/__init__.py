"""Data side: the loader (epoch plans -> this rank's Batches) and what it hands the loop."""

from dcparallel.data.batch import Batch
from dcparallel.data.loader import DataCentricLoader, Step, collate_text, collate_video

__all__ = ["Batch", "DataCentricLoader", "Step", "collate_text", "collate_video"]
