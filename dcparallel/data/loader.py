"""`DataCentricLoader`: an epoch plan turned into this rank's `Batch`es, one `Step` at a time.

Per epoch the loader forms the steps with the planning core's step former (shuffle by
(seed, epoch), consecutive samples up to the step budget), plans each step with a policy,
and hands this rank the micro-batches of its group, loaded and collated by torch
DataLoader workers. Every rank computes the same plans from the same inputs without
communicating (`check_plans=True` compares a hash of every plan across ranks).

    loader = DataCentricLoader(dataset, lengths, policy="dcp", cost=cost, cluster=cluster,
                               tokens_per_step=2**16, seed=0, num_workers=2)
    for epoch in range(start_epoch, num_epochs):
        loader.set_epoch(epoch)                  # keeps a resume position of this epoch
        for step in loader:                      # this rank's Batches of one optimizer step
            for batch in step:                   # may be none: the rank still syncs
                ...
            dc.sync_gradients(); opt.step()
            save({"loader": loader.state_dict(), ...})   # after the optimizer step

Threads and processes: a planning process (or, with ``planning="thread"``, a background
thread) plans `lookahead` steps ahead of what the DataLoader has asked for (plans are pure
functions of the step, so timing cannot change them; the process holds at most `lookahead`
unsent plans); the DataLoader's workers (forked when an epoch's iteration starts, before
the planner starts) load each micro-batch's samples and collate them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import multiprocessing
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch.utils.data import DataLoader, Sampler

from dcparallel.cost.base import CostModel
from dcparallel.data.batch import Batch
from dcparallel.plan import steps as step_former
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import POLICIES, Planner, make_planner
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.runtime import comm
from dcparallel.runtime.shard import IGNORE_INDEX, text_batch, video_batch
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import ClusterSpec, Size, Workload

log = logging.getLogger(__name__)

#: lengths: one size per sample (token count, or (frames, height, width) of a video), or a
#: function of the sample index returning it (called once per sample, then cached)
Lengths = Union[Sequence[Any], Callable[[int], Any]]

#: a custom collate: (loaded samples by id, the micro-batch, its group's ranks, this rank)
#: -> whatever the training loop wants for that micro-batch (usually a `Batch`)
CollateFn = Callable[[Mapping[int, Any], MicroBatch, tuple[int, ...], int], Any]


# ---------------------------------------------------------------- what the loop gets


@dataclass(frozen=True)
class Step:
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


# ---------------------------------------------------------------- validation of lengths


def _bad_length(i: int, value: Any, why: str) -> ValueError:
    return ValueError(
        f"lengths[{i}] = {value!r} {why}; give each sample's size as a positive integer token "
        f"count, or (frames, height, width) of positive integers for a video"
    )


def _positive_int(i: int, whole: Any, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise _bad_length(i, whole, f"is not a number (a {type(v).__name__})")
    if isinstance(v, numbers.Integral):
        n = int(v)
    elif float(v).is_integer():
        n = int(v)
    else:
        raise _bad_length(i, whole, "is not an integer")
    if n <= 0:
        raise _bad_length(i, whole, "is not positive (a sample needs at least one token)")
    return n


def _one_size(i: int, value: Any) -> Size:
    v = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(v, (list, tuple)):
        if len(v) != 3:
            raise _bad_length(i, value, f"has {len(v)} values, not 3")
        return tuple(_positive_int(i, value, x) for x in v)  # type: ignore[return-value]
    return _positive_int(i, value, v)


def check_step_budget(tokens_per_step: Any, samples_per_step: Any) -> None:
    """Exactly one of the two, a positive integer (checked before anything is profiled)."""
    if (tokens_per_step is None) == (samples_per_step is None):
        raise ValueError(f"give exactly one of tokens_per_step or samples_per_step; got "
                         f"tokens_per_step={tokens_per_step!r}, samples_per_step={samples_per_step!r}")
    for name, v in (("tokens_per_step", tokens_per_step), ("samples_per_step", samples_per_step)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0):
            raise ValueError(f"{name} must be a positive integer; got {v!r}")


def read_sizes(lengths: Lengths, num_samples: int) -> tuple[Size, ...]:
    """Every sample's size, validated: `lengths` as a sequence (one entry per sample) or a
    function of the index (called once per index)."""
    if callable(lengths):
        values = [lengths(i) for i in range(num_samples)]
    else:
        try:
            count = len(lengths)
        except TypeError:
            raise ValueError(
                f"lengths must be a sequence with one size per sample or a function of the sample "
                f"index; got a {type(lengths).__name__}"
            ) from None
        if count != num_samples:
            raise ValueError(
                f"lengths has {count} entries but the dataset has {num_samples} samples; give one "
                f"size per sample, lengths[i] = the size of dataset[i]"
            )
        values = [lengths[i] for i in range(num_samples)]
    return tuple(_one_size(i, v) for i, v in enumerate(values))


# ---------------------------------------------------------------- collation


def collate_text(samples: Mapping[int, Any], mb: MicroBatch, ranks: tuple[int, ...], rank: int,
                 ignore_index: int = IGNORE_INDEX) -> Batch:
    """Packs the micro-batch's documents into one row (`cu_seqlens`, per-document positions;
    labels shifted per document before sharding) and returns this rank's shard.

    A sample is a 1-D tensor of token ids, or a mapping with ``input_ids`` and optionally
    ``labels`` (next-token targets aligned with the inputs, ``ignore_index`` where none)."""
    docs, labels = {}, {}
    for sid in mb.sample_ids:
        s = samples[sid]
        if isinstance(s, Mapping):
            if "input_ids" not in s:
                raise ValueError(f"sample {sid} is a mapping without 'input_ids' (keys {sorted(s)}); "
                                 f"return the token ids as 'input_ids' or as a 1-D tensor")
            docs[sid] = torch.as_tensor(s["input_ids"])
            if s.get("labels") is not None:
                labels[sid] = torch.as_tensor(s["labels"])
        else:
            docs[sid] = torch.as_tensor(s)
    if labels and len(labels) != len(docs):
        raise ValueError(f"some samples of {mb.sample_ids} have labels and some do not; give labels for all or none")
    return text_batch(mb, ranks, rank, docs, labels or None, ignore_index)


def collate_video(samples: Mapping[int, Any], mb: MicroBatch, ranks: tuple[int, ...], rank: int) -> Batch:
    """Stacks same-shape video samples as rows and returns this rank's shard. A sample is a
    mapping with ``tokens`` (N, C) patch tokens, ``positions`` (N, 3) and ``frames``
    (latent frames; N = frames x spatial tokens), e.g. from `dcparallel.models.dit.patchify`."""
    for sid in mb.sample_ids:
        s = samples[sid]
        if not isinstance(s, Mapping) or not {"tokens", "positions", "frames"} <= set(s):
            raise ValueError(f"video sample {sid} must be a mapping with 'tokens', 'positions' and "
                             f"'frames'; got {type(s).__name__}")
    frames = {int(samples[s]["frames"]) for s in mb.sample_ids}
    if len(frames) != 1:
        raise ValueError(f"samples {mb.sample_ids} of one micro-batch have different frame counts {sorted(frames)}")
    return video_batch(mb, ranks, rank, {s: samples[s]["tokens"] for s in mb.sample_ids},
                       {s: samples[s]["positions"] for s in mb.sample_ids}, frames.pop())


def resolve_collate(collate: str | CollateFn | None, kind: str, ignore_index: int = IGNORE_INDEX
                    ) -> CollateFn | None:
    """The collate function of a ``collate`` setting: "auto" (text or video by the model's
    kind), "text", "video", a function, or None (the raw samples)."""
    if collate == "auto":
        collate = "video" if kind == "video" else "text"
    if collate == "text":
        return functools.partial(collate_text, ignore_index=ignore_index)
    if collate == "video":
        return collate_video
    if collate is None or callable(collate):
        return collate
    raise ValueError(f"collate must be 'auto', 'text', 'video', a function or None; got {collate!r}")


@dataclass(frozen=True)
class _Task:
    """This rank's micro-batches of one step, to load and collate in one worker call (one
    DataLoader item per step: its per-item overhead, ~1 ms here, is paid once a step)."""

    epoch: int
    step: int
    work: tuple[tuple[MicroBatch, tuple[int, ...]], ...]
    """(micro-batch, its group's ranks), in the order this rank runs them"""
    rank: int


class _TaskDataset(torch.utils.data.Dataset):
    """Maps a `_Task` to its collated micro-batches (runs in the DataLoader workers)."""

    def __init__(self, dataset: Any, collate: CollateFn | None, sizes: tuple[Size, ...], check_text: bool):
        self.dataset, self.collate, self.sizes, self.check_text = dataset, collate, sizes, check_text

    def __getitem__(self, task: _Task) -> list[Any]:  # type: ignore[override]
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


def _identity(x: Any) -> Any:
    return x


class _OneBuffer:
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
            tensors = {name: self.buffer[off:off + n].view(dtype).view(shape) for name, dtype, shape, off, n in specs}
            out.append(Batch(**values, **tensors))
        return out


def _stamp(b: Any, step: int, last: bool, device: torch.device | None) -> Any:
    """A `Batch` with its step and last-of-step flag set (the engine overlaps the gradient
    sync with the last backward), on ``device``; anything else unchanged."""
    if type(b) is not Batch:
        return b
    b = dataclasses.replace(b, step=step, last_of_step=last)
    if device is None or b.inputs.device == device:
        return b
    return (b.pin_memory() if device.type == "cuda" else b).to(device, non_blocking=True)


def _to_worker_result(items: list[Any]) -> Any:
    return _OneBuffer(items) if items and all(type(b) is Batch for b in items) else items


# ---------------------------------------------------------------- planning ahead


class _PlanStream:
    """Plans the steps of one epoch in order on a background thread, `lookahead` steps ahead
    of the furthest step anyone asked for. ``lookahead=0`` plans in the caller's thread."""

    def __init__(self, build: Callable[[], Planner], steps: Sequence[step_former.Step], start: int,
                 lookahead: int, name: str):
        self._build, self._steps, self._lookahead, self._name = build, steps, lookahead, name
        self._planner: Planner | None = None
        self._cond = threading.Condition()
        self._plans: dict[int, StepPlan] = {}
        self._next = start  # next step to plan
        self._demand = start  # 1 + the furthest step asked for
        self._pos = {"sampler": start, "assembler": start}  # the step each reader is at
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.plan_seconds = 0.0

    def _plan(self, k: int) -> StepPlan:
        t0 = time.perf_counter()
        if self._planner is None:
            self._planner = self._build()
        plan = self._planner.plan(self._steps[k])
        assert plan.sample_ids == self._steps[k].sample_ids, "the planner changed the step's samples"
        self.plan_seconds += time.perf_counter() - t0
        return plan

    def get(self, k: int, reader: str) -> StepPlan:
        """Plan k (blocks until it is planned). Two readers walk the steps in order at their
        own pace, the DataLoader's sampler and the step assembler: a plan is dropped once
        both have passed it."""
        with self._cond:
            self._pos[reader] = k
            keep = min(self._pos.values())
            for j in [j for j in self._plans if j < keep]:
                del self._plans[j]
            if self._lookahead == 0:
                if k not in self._plans:
                    self._plans[k] = self._plan(k)
                return self._plans[k]
            if self._thread is None:  # started lazily: after the DataLoader forked its workers
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if k not in self._plans and k + 1 > self._demand:
                self._demand = k + 1
                self._cond.notify_all()
            while k not in self._plans and self._error is None:
                self._cond.wait()
            if k in self._plans:
                return self._plans[k]
            raise RuntimeError(f"planning step {k} failed: {self._error!r}") from self._error

    def ahead(self, k: int) -> None:
        """Lets the thread plan up to step k - 1 + lookahead. Called as a step is handed to the
        loop, so that planning runs while the loop computes, not while it waits for data."""
        with self._cond:
            if k > self._demand:
                self._demand = k
                self._cond.notify_all()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and self._next < len(self._steps) and \
                            self._next >= self._demand + self._lookahead:
                        self._cond.wait()
                    if self._stop or self._next >= len(self._steps):
                        return
                    k = self._next
                plan = self._plan(k)
                with self._cond:
                    self._plans[k] = plan
                    self._next = k + 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()


def _plan_process_main(conn, parent_end, build: Callable[[], Planner], steps: Sequence[step_former.Step],
                       start: int, lookahead: int) -> None:
    """The planning process: plans steps start.. in order, at most `lookahead` steps past the
    furthest step the loader asked for, and sends each plan as it is done. Holds no plan once
    it is sent, so its memory is the planner's bounded caches plus one step. It ends when the
    training process does: the fork copied the parent's end of the pipe, which is closed
    first, so the parent's death is an EOF here (else an orphan planner would outlive a
    crashed rank and hold the launcher's output pipes open)."""
    parent_end.close()
    try:
        planner = build()
        nxt, demand = start, start
        while nxt < len(steps):
            while nxt >= demand + lookahead or conn.poll():
                msg = conn.recv()
                if msg is None:
                    return
                demand = max(demand, msg)
            t0 = time.perf_counter()
            plan = planner.plan(steps[nxt])
            assert plan.sample_ids == steps[nxt].sample_ids, "the planner changed the step's samples"
            conn.send(("plan", nxt, plan, time.perf_counter() - t0))
            nxt += 1
        while conn.recv() is not None:  # wait for the loader to close
            pass
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
        try:
            conn.send(("error", -1, f"{type(e).__name__}: {e}", 0.0))
        except (BrokenPipeError, OSError):
            pass


class _ProcessPlanStream:
    """`_PlanStream`'s interface, the planning done by a child process (forked when the epoch's
    iteration starts, like the DataLoader's workers), so that planning never holds the training
    process's interpreter lock. Plans are pure functions of the step: the same as in-process."""

    def __init__(self, build: Callable[[], Planner], steps: Sequence[step_former.Step], start: int,
                 lookahead: int, name: str):
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_plan_process_main,
                                 args=(child, self._conn, build, steps, start, max(1, lookahead)), name=name,
                                 daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._plans: dict[int, StepPlan] = {}
        self._pos = {"sampler": start, "assembler": start}
        self._demand = start
        self.plan_seconds = 0.0

    def get(self, k: int, reader: str) -> StepPlan:
        with self._lock:
            self._pos[reader] = k
            keep = min(self._pos.values())
            for j in [j for j in self._plans if j < keep]:
                del self._plans[j]
            if k not in self._plans and k + 1 > self._demand:
                self._demand = k + 1
                self._conn.send(self._demand)
            while k not in self._plans:
                try:
                    kind, j, plan, seconds = self._conn.recv()
                except EOFError:
                    raise RuntimeError(f"the planning process ended before step {k} was planned "
                                       f"(exit code {self._proc.exitcode})") from None
                if kind == "error":
                    raise RuntimeError(f"planning step {k} failed in the planning process: {plan}")
                self._plans[j] = plan
                self.plan_seconds += seconds
            return self._plans[k]

    def ahead(self, k: int) -> None:
        with self._lock:
            if k > self._demand:
                self._demand = k
                self._conn.send(k)

    def close(self) -> None:
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join()
        self._conn.close()


class _TaskSampler(Sampler):
    """This rank's micro-batches of steps start.., one `_Task` per step in which it has any."""

    def __init__(self, stream: _PlanStream, epoch: int, start: int, end: int, rank: int):
        self.stream, self.epoch, self.start, self.end, self.rank = stream, epoch, start, end, rank

    def __iter__(self) -> Iterator[_Task]:
        for k in range(self.start, self.end):
            work = self.stream.get(k, "sampler").work_of(self.rank)
            if work:
                yield _Task(self.epoch, k, work, self.rank)


# ---------------------------------------------------------------- the loader


class DataCentricLoader:
    """Iterates this rank's `Step`s of an epoch plan over a map-style dataset.

    Arguments (everything but `dataset` and `lengths` is keyword-only):

    - ``dataset``: map-style (``len`` and ``dataset[i]`` for sample id i).
    - ``lengths``: one size per sample, ``lengths[i]`` = tokens of ``dataset[i]`` (text) or
      its (frames, height, width) in pixels (video); or a function ``lengths(i)``, called once
      per sample when the loader is built.
    - ``policy``: a policy name of `dcparallel.plan.policies.POLICIES` (default "dcp").
    - ``cost``: the cost model (`AnalyticCost` or `ProfiledCost`); its ``model`` is the
      transformer the plans are for.
    - ``cluster``: the cluster planned for; ``cluster.world_size`` must be the world size.
    - ``tokens_per_step`` | ``samples_per_step``: the step budget (exactly one).
    - ``seed``: shuffles the samples per (seed, epoch).
    - ``lookahead``: steps planned ahead (0 = plan when needed, in the iterating thread);
      ``planning``: where: "process" (default: a forked child process, off the training
      process's interpreter lock; a thread in a daemonic process, which may not fork) or
      "thread" (a background thread).
    - ``num_workers``: DataLoader worker processes loading and collating micro-batches
      (0 = in the iterating process); ``prefetch_factor``: micro-batches each worker
      loads ahead.
    - ``collate``: "auto" (text or video by the model's kind), "text", "video", a function
      ``collate(samples_by_id, micro_batch, group_ranks, rank)``, or None (each micro-batch
      is the list of its raw samples, in plan order).
    - ``rank`` / ``world_size``: default to torch.distributed's (1 rank without a process
      group); given explicitly they let one process act as any rank (tests, planning tools).
    - ``skip_oversize``: skip samples that fit no layout (logged, in `summary()`) instead
      of raising.
    - ``check_plans``: debug mode, compares a hash of every step plan across ranks
      (`runtime.comm.check_equal`, one collective per step).
    - ``epoch``: the first epoch (also set by `set_epoch` / `load_state_dict`).
    - ``device``: where the `Batch`es go before the loop gets them (e.g. the model's
      ``cuda:LOCAL_RANK``, from pinned host memory without blocking; default: they stay where
      collate made them, the CPU).

    Raises ValueError before anything runs: an empty dataset, a lengths count that differs
    from the dataset, a zero, negative or non-integer length, a sample larger than any
    layout can hold (`NoLayoutFits`, unless skip_oversize), a bad budget or policy, a
    cluster whose world size is not the launched one.
    """

    def __init__(
        self,
        dataset: Any,
        lengths: Lengths,
        *,
        cost: CostModel,
        cluster: ClusterSpec,
        policy: str = "dcp",
        tokens_per_step: int | None = None,
        samples_per_step: int | None = None,
        seed: int = 0,
        lookahead: int = 2,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        collate: str | CollateFn | None = "auto",
        rank: int | None = None,
        world_size: int | None = None,
        skip_oversize: bool = False,
        check_plans: bool = False,
        epoch: int = 0,
        ignore_index: int = IGNORE_INDEX,
        device: torch.device | str | None = None,
        planning: str = "process",
    ):
        self.device = torch.device(device) if device is not None else None
        try:
            num_samples = len(dataset)
        except TypeError:
            raise ValueError(
                f"the dataset ({type(dataset).__name__}) has no len(): DataCentricLoader needs a "
                f"map-style dataset (len(dataset) and dataset[i])"
            ) from None
        if num_samples == 0:
            raise ValueError("the dataset is empty (len(dataset) == 0): there is nothing to load; "
                             "check the dataset's source and filters")
        check_step_budget(tokens_per_step, samples_per_step)
        if planning not in ("thread", "process"):
            raise ValueError(f"planning must be 'thread' or 'process'; got {planning!r}")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if lookahead < 0 or num_workers < 0 or prefetch_factor < 1:
            raise ValueError(f"lookahead and num_workers must be >= 0, prefetch_factor >= 1; got "
                             f"lookahead={lookahead}, num_workers={num_workers}, prefetch_factor={prefetch_factor}")
        self.world_size = comm.world_size() if world_size is None else int(world_size)
        self.rank = comm.world_rank() if rank is None else int(rank)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world_size} ranks")
        if world_size is None and rank is not None and self.world_size == 1 and self.rank != 0:
            raise ValueError("pass world_size together with rank")
        if cluster.world_size != self.world_size:
            raise ValueError(
                f"the cluster spec plans for world_size={cluster.world_size} but this loader runs on "
                f"{self.world_size} ranks; build the ClusterSpec from the launched world size"
            )

        sizes = read_sizes(lengths, num_samples)
        model = cost.model
        wrong = next((i for i, s in enumerate(sizes) if isinstance(s, tuple) != (model.kind == "video")), None)
        if wrong is not None:
            want = "(frames, height, width) video shapes" if model.kind == "video" else "token counts"
            raise ValueError(f"lengths[{wrong}] = {sizes[wrong]!r}, but the model {model.name!r} is a "
                             f"{model.kind} model: give {want}")
        self.dataset = dataset
        self.sizes: tuple[Size, ...] = sizes
        self.workload = Workload(model, sizes)
        self.cluster = cluster
        self.context = PlanContext(self.workload, cost, cluster, skip_oversize=skip_oversize)
        self.policy = policy
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.seed = int(seed)
        self.lookahead, self.num_workers, self.prefetch_factor = lookahead, num_workers, prefetch_factor
        self.check_plans = check_plans
        self.planning = planning

        fn = resolve_collate(collate, model.kind, ignore_index)
        self._tasks = _TaskDataset(dataset, fn, sizes, check_text=collate == "text" or (
            collate == "auto" and model.kind == "text"))

        self._data_digest = comm.digest((self.workload.tokens, tuple(self.context.usable_ids), self.seed,
                                         tokens_per_step, samples_per_step))
        self.epoch = int(epoch)
        self._step = 0  # steps of this epoch handed out (what state_dict reports)
        self._start = 0  # where the next iteration starts
        self._steps_cache: tuple[int, list[step_former.Step]] | None = None
        self.last_plan_seconds = 0.0
        if self.context.skipped:
            log.warning("skipping %d sample(s) that fit no layout: %s", len(self.context.skipped),
                        ", ".join(f"sample {i} (size {s!r}, needs {need / 2**30:.1f} GiB)"
                                  for i, s, need in self.context.skipped[:10])
                        + (" ..." if len(self.context.skipped) > 10 else ""))
        self.steps(self.epoch)  # validates the budget now
        log.info("rank %d/%d: %d samples (%d usable), policy %s, %d steps in epoch %d",
                 self.rank, self.world_size, num_samples, len(self.context.usable_ids), policy,
                 len(self), self.epoch)

    # -------------------------------------------------------------- epochs and state

    def steps(self, epoch: int) -> list[step_former.Step]:
        """The steps (sample ids per optimizer step) of an epoch: the same for every policy
        and world size."""
        if self._steps_cache is None or self._steps_cache[0] != epoch:
            steps = step_former.form_steps(self.workload.tokens, seed=self.seed, epoch=epoch,
                                           tokens_per_step=self.tokens_per_step,
                                           samples_per_step=self.samples_per_step, ids=self.context.usable_ids)
            self._steps_cache = (epoch, steps)
        return self._steps_cache[1]

    def planner(self, epoch: int) -> Planner:
        """A planner for the epoch (tuned baselines look at the epoch's steps)."""
        return make_planner(self.policy, self.context, self.steps(epoch), score=step_seconds(self.context))

    def plans(self, epoch: int | None = None, progress: bool = False) -> list[StepPlan]:
        """Every step plan of an epoch (default: the current one), planned here and now;
        ``progress``: a progress bar on stderr (an epoch of 10^6 samples takes minutes)."""
        e = self.epoch if epoch is None else epoch
        planner = self.planner(e)
        steps = self.steps(e)
        if not progress:
            return [planner.plan(s) for s in steps]
        import sys

        from tqdm import tqdm

        return [planner.plan(s) for s in tqdm(steps, desc=f"planning epoch {e} ({self.policy})", unit="step",
                                              file=sys.stderr, mininterval=1.0)]

    def __len__(self) -> int:
        """Steps in the current epoch."""
        return len(self.steps(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        """Moves to `epoch`, starting at its first step, unless a state loaded with
        `load_state_dict` is for this very epoch (then iteration resumes where it stopped)."""
        epoch = int(epoch)
        if epoch == self.epoch and self._start > 0:
            return
        self.epoch, self._step, self._start = epoch, 0, 0

    def state_dict(self) -> dict[str, Any]:
        """{epoch, step (steps of the epoch already handed out), ...}: take it after the
        optimizer step of the step last yielded."""
        return {"epoch": self.epoch, "step": self._step, "num_steps": len(self), "seed": self.seed,
                "policy": self.policy, "world_size": self.world_size, "num_samples": len(self.sizes),
                "tokens_per_step": self.tokens_per_step, "samples_per_step": self.samples_per_step,
                "data_digest": self._data_digest}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues at ``state['step']`` of ``state['epoch']``: the remaining steps hold
        exactly the samples (and, with the same policy and cluster, the plans) an
        uninterrupted run would have seen. Another world size or policy keeps the samples
        of every step and re-plans them."""
        for key in ("seed", "num_samples", "tokens_per_step", "samples_per_step"):
            mine = getattr(self, key) if key != "num_samples" else len(self.sizes)
            if key in state and state[key] != mine:
                raise ValueError(f"the state was saved with {key}={state[key]!r} but this loader has "
                                 f"{key}={mine!r}; resume with the same {key} (it decides the epoch's steps)")
        if state.get("data_digest", self._data_digest) != self._data_digest:
            raise ValueError("the state was saved for other sample lengths (or other skipped samples); "
                             "resume with the same dataset, lengths and skip_oversize")
        epoch, step = int(state["epoch"]), int(state["step"])
        num_steps = len(self.steps(epoch))
        if not 0 <= step <= num_steps:
            raise ValueError(f"state step {step} is outside epoch {epoch}'s {num_steps} steps")
        for key in ("policy", "world_size"):
            if key in state and state[key] != getattr(self, key):
                log.info("resuming with %s=%r (saved with %r): same samples per step, re-planned",
                         key, getattr(self, key), state[key])
        self.epoch, self._step, self._start = epoch, step, step

    def summary(self) -> dict[str, Any]:
        """What the loader plans over: sample counts, skipped samples, steps of the epoch."""
        return {"num_samples": len(self.sizes), "num_usable": len(self.context.usable_ids),
                "skipped": [{"sample": i, "size": s, "needs_gib": need / 2**30} for i, s, need in self.context.skipped],
                "epoch": self.epoch, "num_steps": len(self), "policy": self.policy,
                "world_size": self.world_size, "rank": self.rank}

    # -------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Step]:
        return self._iterate(self.epoch, self._start)

    def _iterate(self, epoch: int, start: int) -> Iterator[Step]:
        self._start = 0
        self._step = start
        steps = self.steps(epoch)
        in_process = self.planning == "process" and self.lookahead > 0
        if in_process and multiprocessing.current_process().daemon:
            # a daemonic process (e.g. a multiprocessing pool worker) may not start children
            log.warning("rank %d: planning in a thread, not a process: this process is daemonic", self.rank)
            in_process = False
        kind = _ProcessPlanStream if in_process else _PlanStream
        stream = kind(functools.partial(self.planner, epoch), steps, start, self.lookahead,
                      name=f"dcparallel-plan-e{epoch}")
        loader = DataLoader(self._tasks, sampler=_TaskSampler(stream, epoch, start, len(steps), self.rank),
                            batch_size=None, collate_fn=_to_worker_result if self.num_workers else _identity,
                            num_workers=self.num_workers,
                            prefetch_factor=self.prefetch_factor if self.num_workers else None)
        it = iter(loader)  # forks the workers (before the planning thread exists)
        t_epoch = time.perf_counter()
        try:
            for k in range(start, len(steps)):
                plan = stream.get(k, "assembler")
                if self.check_plans:
                    comm.check_equal(comm.digest(plan.to_json()), f"plan of epoch {epoch} step {k}")
                work = plan.work_of(self.rank)
                batches: tuple[Any, ...] = ()
                if work:
                    got = next(it)
                    batches = tuple(got.unpack() if isinstance(got, _OneBuffer) else got)
                for b, (mb, _) in zip(batches, work, strict=True):
                    got = getattr(b, "sample_ids", None)
                    assert got is None or tuple(got) == mb.sample_ids, (got, mb.sample_ids)
                batches = tuple(_stamp(b, k, j == len(batches) - 1, self.device) for j, b in enumerate(batches))
                self._step = k + 1
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("rank %d epoch %d step %d/%d: micro-batches (group ranks, sample ids) %s", self.rank,
                              epoch, k, len(steps), json.dumps([[list(r), list(mb.sample_ids)] for mb, r in work]))
                if self.lookahead:
                    stream.ahead(k + 2)
                yield Step(epoch, k, len(steps), self.rank, plan, batches)
            log.info("rank %d: epoch %d done, steps %d..%d in %.2f s (planning %.3f s)", self.rank, epoch,
                     start, len(steps) - 1, time.perf_counter() - t_epoch, stream.plan_seconds)
        finally:
            stream.close()
            self.last_plan_seconds = stream.plan_seconds
            del it
