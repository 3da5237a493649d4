"""`DataCentricLoader`: an epoch plan turned into this rank's `Batch`es, one `LoaderStep` at a time.

Per epoch the loader forms the steps with the planning core's step former (shuffle by
(seed, epoch), consecutive samples up to the step budget), plans each step with a policy,
and hands this rank the micro-batches of its group, loaded and collated by torch
DataLoader workers. Every rank computes the same plans from the same inputs without
communicating; `check_plans` compares them across ranks every so many steps (`plan_check`).

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
unsent plans; a fresh interpreter, not a fork, kept for later epochs: `plan_stream`).
DataLoader workers (forked as an epoch's iteration starts) load and collate micro-batches.
A `break` or an exception out of the loop ends the iteration at once (a plan in flight is
not awaited: `plan_stream`); `close()` / ``with loader:`` end open iterations and idle
planning processes by hand.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from dcparallel.cost.base import CostModel
from dcparallel.cost.refined import RefinedCost
from dcparallel.data import plan_check, plan_stream, refine
from dcparallel.data.collate import IGNORE_INDEX, CollateFn, resolve_collate
from dcparallel.data.loader_step import LoaderStep
from dcparallel.data.plan_stream import PlanStream, predictor
from dcparallel.data.sizes import Lengths, check_kind, check_step_budget, read_sizes
from dcparallel.data.transport import OneBuffer, TaskDataset, TaskSampler, identity, stamp, to_worker_result
from dcparallel.plan import steps as step_former
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import Planner, make_planner, user_policy
from dcparallel.plan.types import StepPlan
from dcparallel.runtime import comm
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import ClusterSpec, Size, Workload, format_bytes

log = logging.getLogger(__name__)

__all__ = ["DataCentricLoader", "LoaderStep", "check_step_budget", "read_sizes"]


# ---------------------------------------------------------------- the loader


class DataCentricLoader:
    """Iterates this rank's `LoaderStep`s of an epoch plan over a map-style dataset.

    Arguments (everything but `dataset` and `lengths` is keyword-only):

    - ``dataset``: map-style (``len`` and ``dataset[i]`` for sample id i).
    - ``lengths``: one size per sample, ``lengths[i]`` = tokens of ``dataset[i]`` (text) or
      its (frames, height, width) in pixels (video); or a function ``lengths(i)``, called once
      per sample when the loader is built.
    - ``policy``: `dcp` (default), `bucket` or `packed` (`dcparallel.plan.policies.POLICIES`);
      ``research=True`` also takes a research policy's name (`RESEARCH`).
    - ``cost``: the cost model (`AnalyticCost` or `ProfiledCost`); its ``model`` is the
      transformer the plans are for.
    - ``cluster``: the cluster planned for; ``cluster.world_size`` must be the world size.
    - ``tokens_per_step`` | ``samples_per_step``: the step budget (exactly one).
    - ``seed``: shuffles the samples per (seed, epoch).
    - ``lookahead``: steps planned ahead (0 = plan when needed, in the iterating thread);
      ``planning``: where: "process" (default: a planning process, off the training
      process's interpreter lock; see above) or "thread" (a background thread).
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
    - ``check_plans``: the ranks compare their plans (`plan_check`) on the first step iterated
      and every step whose index is a multiple of this (1: every step, 0: never).
    - ``epoch``: the first epoch (also set by `set_epoch` / `load_state_dict`).
    - ``device``: where the `Batch`es go before the loop gets them (e.g. the model's
      ``cuda:LOCAL_RANK``, from pinned host memory without blocking; default: they stay where
      collate made them, the CPU).
    - ``predict``: each step comes with the simulator's replay of its plan
      (`LoaderStep.predicted`), made where the plan is, off the training loop.
    - ``refine_steps``: the first this many steps feed their micro-batch times (`observe`) to
      the cost model, wrapped in a `RefinedCost`; each is planned after the last was fed
      (`data.refine`). 0 (default): the cost model is used as given.
      A CPU-calibrated analytic model (`cost = "analytic"` on a CPU) is tracked after them:
      every step fed to `observe` rescales its prices by the median ratio of measured to
      priced seconds of the last `refine.TRACK_STEPS` steps fed, and each step is planned
      after the last was fed (its estimate one step behind; planning does not overlap
      training). A loop that does not call `observe` ends it after the first step.

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
        research: bool = False,
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
        check_plans: int = plan_check.CHECK_PLANS_EVERY,
        epoch: int = 0,
        ignore_index: int = IGNORE_INDEX,
        device: torch.device | str | None = None,
        planning: str = "process",
        predict: bool = False,
        refine_steps: int = 0,
    ):
        self.device = torch.device(device) if device is not None else None
        num_samples = _dataset_length(dataset)
        check_step_budget(tokens_per_step, samples_per_step)
        _check_pipeline(planning, lookahead, num_workers, prefetch_factor)
        user_policy(policy, "DataCentricLoader", research=research)
        self.world_size, self.rank = _world_and_rank(cluster, world_size, rank)

        self.refine_left, self._refined = refine.check_steps(refine_steps), []  # steps still to feed; rows fed
        self.tracking, self._fed = refine.track_steps(cost), 0  # steps of the tracked scale; steps fed
        cost = refine.wrapped(cost, refine_steps, self.tracking)
        self.dataset, self.sizes = dataset, read_sizes(lengths, num_samples)
        check_kind(self.sizes, cost.model)
        self.workload = Workload(cost.model, self.sizes)
        self.cluster, self.policy = cluster, policy
        self.context = PlanContext(self.workload, cost, cluster, skip_oversize=skip_oversize)
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.seed = int(seed)
        self.lookahead, self.num_workers, self.prefetch_factor = lookahead, num_workers, prefetch_factor
        self.check_plans = plan_check.check_every(check_plans)
        self.planning, self.predict = planning, predict  # where plans are made; with a replay each
        self._idle_workers: list[plan_stream.PlanWorker] = []  # planning processes between epochs
        weakref.finalize(self, plan_stream.close_workers, self._idle_workers)
        self._open: weakref.WeakSet[Iterator[LoaderStep]] = weakref.WeakSet()  # iterations not yet closed
        self._tasks = _task_dataset(dataset, collate, cost.model.kind, ignore_index, self.sizes)
        self._data_digest = comm.digest(
            (self.workload.tokens, tuple(self.context.usable_ids), self.seed, tokens_per_step, samples_per_step)
        )
        self.epoch = int(epoch)
        self._step, self._start = 0, 0  # steps of this epoch handed out (state_dict); where iteration starts
        self._steps_cache: tuple[int, list[step_former.Step]] | None = None
        self.last_plan_seconds, self.last_plan_waits = 0.0, []  # last epoch: s planning, steps that waited
        _log_skipped(self.context.skipped)
        self.steps(self.epoch)  # validates the budget now
        self._log_start(num_samples)

    def _log_start(self, num_samples: int) -> None:
        log.info(
            "rank %d/%d: %d samples (%d usable), policy %s, %d steps in epoch %d",
            self.rank,
            self.world_size,
            num_samples,
            len(self.context.usable_ids),
            self.policy,
            len(self),
            self.epoch,
        )

    # -------------------------------------------------------------- epochs and state

    def steps(self, epoch: int) -> list[step_former.Step]:
        """The steps (sample ids per optimizer step) of an epoch: the same for every policy
        and world size."""
        if self._steps_cache is None or self._steps_cache[0] != epoch:
            steps = step_former.form_steps(
                self.workload.tokens,
                seed=self.seed,
                epoch=epoch,
                tokens_per_step=self.tokens_per_step,
                samples_per_step=self.samples_per_step,
                ids=self.context.usable_ids,
            )
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

        return [
            planner.plan(s)
            for s in tqdm(
                steps, desc=f"planning epoch {e} ({self.policy})", unit="step", file=sys.stderr, mininterval=1.0
            )
        ]

    def __len__(self) -> int:
        """Steps in the current epoch."""
        return len(self.steps(self.epoch))

    def start_planning(self) -> None:
        """Starts the planning process now and waits until it is ready (about 0.2 s), not in step 1."""
        if self.planning == "process" and self.lookahead > 0:
            idle = self._idle_workers
            idle.append(plan_stream.idle_worker(idle, self.policy, self.context, self.predict))

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
        return {
            "epoch": self.epoch,
            "step": self._step,
            "num_steps": len(self),
            "seed": self.seed,
            "policy": self.policy,
            "world_size": self.world_size,
            "num_samples": len(self.sizes),
            "tokens_per_step": self.tokens_per_step,
            "samples_per_step": self.samples_per_step,
            "data_digest": self._data_digest,
            "refine": {"left": self.refine_left, "rows": list(self._refined)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues at ``state['step']`` of ``state['epoch']``: the remaining steps hold
        exactly the samples (and, with the same policy and cluster, the plans) an
        uninterrupted run would have seen. Another world size or policy keeps the samples
        of every step and re-plans them."""
        for key in ("seed", "num_samples", "tokens_per_step", "samples_per_step"):
            mine = getattr(self, key) if key != "num_samples" else len(self.sizes)
            if key in state and state[key] != mine:
                raise ValueError(
                    f"the state was saved with {key}={state[key]!r} but this loader has "
                    f"{key}={mine!r}; resume with the same {key} (it decides the epoch's steps)"
                )
        if state.get("data_digest", self._data_digest) != self._data_digest:
            raise ValueError(
                "the state was saved for other sample lengths (or other skipped samples); "
                "resume with the same dataset, lengths and skip_oversize"
            )
        epoch, step = int(state["epoch"]), int(state["step"])
        num_steps = len(self.steps(epoch))
        if not 0 <= step <= num_steps:
            raise ValueError(f"state step {step} is outside epoch {epoch}'s {num_steps} steps")
        for key in ("policy", "world_size"):
            if key in state and state[key] != getattr(self, key):
                log.info(
                    "resuming with %s=%r (saved with %r): same samples per step, re-planned",
                    key,
                    getattr(self, key),
                    state[key],
                )
        self.epoch, self._step, self._start = epoch, step, step
        if self.refine_left or self._refined:  # the fits the saved run planned with, from its rows
            plan_stream.close_workers(self._idle_workers)  # they hold the fits of this process's run
            self.context.cost, self._refined = RefinedCost(self.context.cost.inner, self.tracking), []
            saved = state.get("refine", {"left": self.refine_left, "rows": []})
            self.observe_rows(saved["rows"], count=False)
            self.refine_left = saved["left"]

    def observe(self, step: LoaderStep, seconds: list[float]) -> bool:
        """Feeds the seconds each of ``step``'s batches took on this rank (in order) to the cost model, a
        collective (every rank, every step) while steps remain to refine or the scale is tracked;
        else False, no collective."""
        if not (self.refine_left or self.tracking):
            return False
        rows = refine.step_rows(step.plan, self.rank, self.world_size, self.sizes, seconds)
        if self.refine_left:
            self.observe_rows(rows)
        else:
            refine.feed(self, rows, count=False, track=True)
        self._fed += 1
        return True

    def observe_rows(self, rows: list, count: bool = True) -> None:  # rows: `data.refine.Row`s, alike on every rank
        refine.feed(self, rows, count)

    @property
    def idle_workers(self) -> list[plan_stream.PlanWorker]:
        """The planning processes waiting between epochs (`refine.feed` tells them each new fit)."""
        return self._idle_workers

    @property
    def refined(self) -> list:
        """The measured rows fed so far (`refine.feed` appends to it; `state_dict` saves it)."""
        return self._refined

    def summary(self) -> dict[str, Any]:
        """What the loader plans over: sample counts, skipped samples, steps of the epoch."""
        return {
            "num_samples": len(self.sizes),
            "num_usable": len(self.context.usable_ids),
            "skipped": [{"sample": i, "size": s, "needs_gib": need / 2**30} for i, s, need in self.context.skipped],
            "epoch": self.epoch,
            "num_steps": len(self),
            "policy": self.policy,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    # -------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[LoaderStep]:
        it = self._iterate(self.epoch, self._start)
        self._open.add(it)
        return it

    def close(self) -> None:
        """Ends every iteration still open (its planning, its DataLoader workers) and the idle
        planning processes, at once (a plan in flight is not awaited). A `break` or an
        exception out of ``for step in loader`` ends its iteration by itself; this is for
        iterators kept by hand, and for a run that wants nothing left running now. The
        loader stays usable: the next iteration starts a new planning process."""
        for it in list(self._open):
            it.close()
        plan_stream.close_workers(self._idle_workers)

    def __enter__(self) -> DataCentricLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _iterate(self, epoch: int, start: int) -> Iterator[LoaderStep]:
        self._start = 0
        self._step = start
        self.last_plan_seconds, self.last_plan_waits = 0.0, []
        k, num_steps = start, len(self.steps(epoch))
        while k < num_steps and (self.refine_left or self.tracking):  # one step at a time, each planned after
            fed = self._fed  # the last was fed
            yield from list(self._segment(epoch, k, k + 1))  # its stream and DataLoader closed before the yield
            k += 1
            if self._fed == fed:  # the loop did not feed this step: refining and tracking end (alike on every rank)
                self.refine_left = self.tracking = 0
        yield from self._segment(epoch, k, num_steps)

    def _segment(self, epoch: int, start: int, end: int) -> Iterator[LoaderStep]:
        steps = self.steps(epoch)
        stream = self._plan_stream(epoch, steps, start, end)
        loader = DataLoader(
            self._tasks,
            sampler=TaskSampler(stream, epoch, start, end, self.rank),
            batch_size=None,
            collate_fn=to_worker_result if self.num_workers else identity,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
        )
        it = iter(loader)  # forks the DataLoader's workers (before the planning thread exists)
        t_epoch = time.perf_counter()
        try:
            for k in range(start, end):
                plan, predicted = stream.get(k, "assembler"), stream.prediction(k)
                plan.check_shard_blocks(getattr(self.cluster, "shard_size", 1))  # same plan, same answer, every rank
                if self.check_plans and (k == start or k % self.check_plans == 0):
                    plan_check.check_same_plan(plan, epoch, k)
                batches = self._batches_of(plan, it, k)
                self._step = k + 1
                self._log_step(plan, epoch, k, len(steps))
                if self.lookahead:
                    stream.ahead(k + 2)
                yield LoaderStep(epoch, k, len(steps), self.rank, plan, batches, predicted)
            if end == len(steps):
                log.info(
                    "rank %d: epoch %d done, steps %d..%d in %.2f s (planning %.3f s)",
                    self.rank,
                    epoch,
                    start,
                    end - 1,
                    time.perf_counter() - t_epoch,
                    stream.plan_seconds,
                )
        finally:
            stream.close()
            self.last_plan_seconds += stream.plan_seconds
            self.last_plan_waits += stream.waited
            del it

    def _plan_stream(
        self, epoch: int, steps: list[step_former.Step], start: int, end: int
    ) -> PlanStream | plan_stream.ProcessPlanStream:
        """The plans of steps ``start..end-1``: from a planning process, or a thread of this one."""
        if self.planning == "process" and self.lookahead > 0:
            worker = plan_stream.idle_worker(self._idle_workers, self.policy, self.context, self.predict)
            return plan_stream.ProcessPlanStream(worker, steps, start, self.lookahead, self._idle_workers, stop=end)
        return PlanStream(
            functools.partial(self.planner, epoch),
            steps,
            start,
            self.lookahead,
            name=f"dcparallel-plan-e{epoch}",
            stop=end,
            predict=predictor(self.context) if self.predict else None,
        )

    def _batches_of(self, plan: StepPlan, it: Iterator[Any], k: int) -> tuple[Any, ...]:
        """This rank's `Batch`es of step ``k`` (none when the plan gives it no work), from the DataLoader
        iterator ``it``, stamped with the step and the last-micro-batch flag and moved to the device."""
        work = plan.work_of(self.rank)
        batches: tuple[Any, ...] = ()
        if work:
            got = next(it)
            batches = tuple(got.unpack() if isinstance(got, OneBuffer) else got)
        for b, (mb, _) in zip(batches, work, strict=True):
            got = getattr(b, "sample_ids", None)
            assert got is None or tuple(got) == mb.sample_ids, (got, mb.sample_ids)
        return tuple(stamp(b, k, j == len(batches) - 1, self.device) for j, b in enumerate(batches))

    def _log_step(self, plan: StepPlan, epoch: int, k: int, num_steps: int) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "rank %d epoch %d step %d/%d: micro-batches (group ranks, sample ids) %s",
                self.rank,
                epoch,
                k,
                num_steps,
                json.dumps([[list(r), list(mb.sample_ids)] for mb, r in plan.work_of(self.rank)]),
            )


# ---------------------------------------------------------------- checks of the arguments


def _dataset_length(dataset: Any) -> int:
    """``len(dataset)``, refused for a dataset without one or an empty one."""
    try:
        num_samples = len(dataset)
    except TypeError:
        raise ValueError(
            f"the dataset ({type(dataset).__name__}) has no len(): DataCentricLoader needs a "
            f"map-style dataset (len(dataset) and dataset[i])"
        ) from None
    if num_samples == 0:
        raise ValueError(
            "the dataset is empty (len(dataset) == 0): there is nothing to load; check the dataset's source and filters"
        )
    return num_samples


def _check_pipeline(planning: str, lookahead: int, num_workers: int, prefetch_factor: int) -> None:
    """Refuses a planning place other than a thread or a process, and negative queue sizes."""
    if planning not in ("thread", "process"):
        raise ValueError(f"planning must be 'thread' or 'process'; got {planning!r}")
    if lookahead < 0 or num_workers < 0 or prefetch_factor < 1:
        raise ValueError(
            f"lookahead and num_workers must be >= 0, prefetch_factor >= 1; got "
            f"lookahead={lookahead}, num_workers={num_workers}, prefetch_factor={prefetch_factor}"
        )


def _world_and_rank(cluster: ClusterSpec, world_size: int | None, rank: int | None) -> tuple[int, int]:
    """(world size, rank): torch.distributed's unless given; the cluster must plan for that world."""
    world = comm.world_size() if world_size is None else int(world_size)
    me = comm.world_rank() if rank is None else int(rank)
    if not 0 <= me < world:
        raise ValueError(f"rank {me} is outside the world of {world} ranks")
    if world_size is None and rank is not None and world == 1 and me != 0:
        raise ValueError("pass world_size together with rank")
    if cluster.world_size != world:
        raise ValueError(
            f"the cluster spec plans for world_size={cluster.world_size} but this loader runs on "
            f"{world} ranks; build the ClusterSpec from the launched world size"
        )
    return world, me


def _task_dataset(
    dataset: Any, collate: str | CollateFn | None, kind: str, ignore_index: int, sizes: tuple[Size, ...]
) -> TaskDataset:
    """What the DataLoader workers run: load a micro-batch's samples and collate them."""
    fn = resolve_collate(collate, kind, ignore_index)
    return TaskDataset(dataset, fn, sizes, check_text=collate == "text" or (collate == "auto" and kind == "text"))


def _log_skipped(skipped: list) -> None:
    """Warns of the samples that fit no layout (the first ten, by id, size and need)."""
    if skipped:
        log.warning(
            "skipping %d sample(s) that fit no layout: %s",
            len(skipped),
            ", ".join(f"sample {i} (size {s!r}, needs {format_bytes(need)})" for i, s, need in skipped[:10])
            + (" ..." if len(skipped) > 10 else ""),
        )
