"""The worker transport: a step's micro-batches as one DataLoader task, loaded and collated in a worker.

One DataLoader item per step (`Task`, yielded by `TaskSampler` from the planning stream);
a worker loads its samples, collates them (`TaskDataset`) and ships the step's `Batch`es
back in one byte buffer (`OneBuffer`); `stamp` marks each with its step and moves it to the
training device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from dcparallel.data.batch import Batch
from dcparallel.data.collate import CollateFn
from dcparallel.data.plan_stream import PlanStream, ProcessPlanStream
from dcparallel.plan.types import MicroBatch
from dcparallel.spec import Size


@dataclass(frozen=True)
class Task:
    """This rank's micro-batches of one step, to load and collate in one worker call (one
    DataLoader item per step: its per-item overhead, ~1 ms here, is paid once a step)."""

    epoch: int
    step: int
    work: tuple[tuple[MicroBatch, tuple[int, ...]], ...]
    """(micro-batch, its group's ranks), in the order this rank runs them"""
    rank: int


class TaskDataset(torch.utils.data.Dataset):
    """Maps a `Task` to its collated micro-batches (runs in the DataLoader workers)."""

    def __init__(self, dataset: Any, collate: CollateFn | None, sizes: tuple[Size, ...], check_text: bool):
        self.dataset, self.collate, self.sizes, self.check_text = dataset, collate, sizes, check_text

    def __getitem__(self, task: Task) -> list[Any]:  # type: ignore[override]
        return [self._one(mb, ranks, task.rank) for mb, ranks in task.work]

    def _one(self, mb: MicroBatch, ranks: tuple[int, ...], rank: int) -> Any:
        samples = {sid: self.dataset[sid] for sid in mb.sample_ids}
        if self.check_text:
            for sid, s in samples.items():
                ids = s["input_ids"] if isinstance(s, Mapping) else s
                n = int(torch.as_tensor(ids).numel())
                if n != self.sizes[sid]:
                    raise ValueError(
                        f"sample {sid} has {n} tokens but lengths[{sid}] = {self.sizes[sid]}; the plan is "
                        f"built from lengths, so they must be the samples' real token counts"
                    )
        if self.collate is None:
            return [samples[sid] for sid in mb.sample_ids]
        return self.collate(samples, mb, ranks, rank)

    def __len__(self) -> int:
        return len(self.dataset)


def identity(x: Any) -> Any:
    return x


class OneBuffer:
    """A step's `Batch`es on their way from a DataLoader worker: all their tensors copied
    into one byte buffer, so that the main process rebuilds one shared-memory tensor per step
    instead of five per micro-batch (each costs ~0.5 ms with the default file-descriptor
    sharing, measured here)."""

    def __init__(self, batches: list[Batch]):
        self.values: list[dict[str, Any]] = []
        self.specs: list[list[tuple[str, torch.dtype, tuple[int, ...], int, int]]] = []
        parts, offset = [], 0
        for batch in batches:
            values, specs = {}, []
            for f in dataclasses.fields(batch):
                v = getattr(batch, f.name)
                if not isinstance(v, torch.Tensor):
                    values[f.name] = v
                    continue
                raw = v.detach().contiguous().reshape(-1).view(torch.uint8)
                pad = -raw.numel() % 8  # keeps every tensor 8-byte aligned for view(dtype)
                specs.append((f.name, v.dtype, tuple(v.shape), offset, raw.numel()))
                parts += [raw, raw.new_zeros(pad)]
                offset += raw.numel() + pad
            self.values.append(values)
            self.specs.append(specs)
        self.buffer = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)

    def unpack(self) -> list[Batch]:
        out = []
        for values, specs in zip(self.values, self.specs, strict=True):
            tensors = {name: self.buffer[off : off + n].view(dtype).view(shape) for name, dtype, shape, off, n in specs}
            out.append(Batch(**values, **tensors))
        return out


def stamp(b: Any, step: int, last: bool, device: torch.device | None) -> Any:
    """A `Batch` with its step and last-of-step flag set (the engine overlaps the gradient
    sync with the last backward), on ``device``; anything else unchanged."""
    if type(b) is not Batch:
        return b
    b = dataclasses.replace(b, step=step, last_of_step=last)
    if device is None or b.inputs.device == device:
        return b
    return (b.pin_memory() if device.type == "cuda" else b).to(device, non_blocking=True)


def to_worker_result(items: list[Any]) -> Any:
    return OneBuffer(items) if items and all(type(b) is Batch for b in items) else items


class TaskSampler(Sampler):
    """This rank's micro-batches of steps start.., one `Task` per step in which it has any."""

    def __init__(self, stream: PlanStream | ProcessPlanStream, epoch: int, start: int, end: int, rank: int):
        self.stream, self.epoch, self.start, self.end, self.rank = stream, epoch, start, end, rank

    def __iter__(self) -> Iterator[Task]:
        for k in range(self.start, self.end):
            work = self.stream.get(k, "sampler").work_of(self.rank)
            if work:
                yield Task(self.epoch, k, work, self.rank)
