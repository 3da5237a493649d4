"""Data side: the loader (epoch plans -> this rank's Batches) and what it hands the loop."""

from dcparallel.data.batch import Batch
from dcparallel.data.collate import collate_text, collate_video
from dcparallel.data.loader import DataCentricLoader, LoaderStep

__all__ = ["Batch", "DataCentricLoader", "LoaderStep", "collate_text", "collate_video"]
