"""Data side: what the loader hands the training loop."""

from dcparallel.data.batch import Batch

__all__ = ["Batch"]
