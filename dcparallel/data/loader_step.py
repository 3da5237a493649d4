"""`LoaderStep`: what a training loop gets from `DataCentricLoader` per optimizer step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dcparallel.data.batch import Batch
from dcparallel.data.plan_stream import StepPrediction
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan


@dataclass(frozen=True)
class LoaderStep:
    """This rank's part of one optimizer step: one item per micro-batch it runs, in order
    (its group's micro-batches in each phase of the step, phase by phase). Empty when the
    rank's groups have no micro-batch this step (the rank still joins the gradient sync)."""

    epoch: int
    index: int
    """step index within the epoch (0-based)"""
    num_steps: int
    """steps in this epoch"""
    rank: int
    plan: StepPlan
    """the whole step plan (every rank's groups); identical on every rank"""
    batches: tuple[Any, ...]
    """`Batch`es (or what a custom collate returns; the raw samples with collate=None)"""
    predicted: StepPrediction | None = None
    """the simulator's replay of the whole plan (the loader's ``predict``), else None"""

    @property
    def groups(self) -> tuple[GroupPlan, ...]:
        """This rank's group in each phase of the step."""
        return self.plan.groups_of(self.rank)

    @property
    def micro_batches(self) -> tuple[MicroBatch, ...]:
        return tuple(mb for mb, _ in self.plan.work_of(self.rank))

    @property
    def sample_ids(self) -> tuple[int, ...]:
        """This rank's samples in this step (shared with the other ranks of their SP groups)."""
        return tuple(i for mb in self.micro_batches for i in mb.sample_ids)

    @property
    def num_samples(self) -> int:
        """Samples of the whole step, over all ranks: the normalizer of a sample-mean loss."""
        return len(self.plan.sample_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole step as planned (the exact target count is summed at run time,
        in the gradient all-reduce)."""
        return self.plan.num_tokens

    @property
    def num_targets(self) -> dict[int, int]:
        """Targets of each of this rank's samples, counted on the whole sample before
        sharding (empty unless the batches are `Batch`es)."""
        out: dict[int, int] = {}
        for b in self.batches:
            if isinstance(b, Batch):
                out.update(zip(b.sample_ids, b.num_targets, strict=True))
        return out

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
