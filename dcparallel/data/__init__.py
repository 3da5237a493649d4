"""Data side: the loader (epoch plans -> this rank's Batches) and what it hands the loop, and
the readers of real datasets (`text_dataset`, `latents_dataset`; their optional
dependencies are imported only when a format needs them)."""

from dcparallel.data.batch import Batch
from dcparallel.data.collate import collate_text, collate_video
from dcparallel.data.latents_data import latents_dataset
from dcparallel.data.loader import DataCentricLoader, LoaderStep
from dcparallel.data.text_data import text_dataset

__all__ = [
    "Batch",
    "DataCentricLoader",
    "LoaderStep",
    "collate_text",
    "collate_video",
    "latents_dataset",
    "text_dataset",
]
