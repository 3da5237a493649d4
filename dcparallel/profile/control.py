"""Where the ranks of a profile wait for each other, and how an SP group stops together.

Waiting: every agreement and object exchange of profiling runs on a gloo group with the
control timeout (`comm.control_timeout_s`): the world's `comm.control_group`, and for an SP
group of 2 .. world-1 ranks its gloo twin (`ControlGroups`). A rank waiting for a slower one
— a rank with no layout left waiting for the busiest group, a group waiting for a member
still measuring an SP-1 layout — so waits under that long timeout, never inside a collective
of a training (NCCL) group, whose watchdog would end the job. The only collectives left on
training groups are the measured runs' own, which a group's ranks enter after agreeing here
that all of them are ready (`run_together`).

Stopping together (`run_together`): a rank that runs out of memory, or raises, must not
leave the other ranks of its group inside a collective it will never join. After each run
the group agrees on every rank's outcome; in an untimed run it also agrees before each of
the run's collectives (`comm.collective_guard`), so a rank that fails mid-run is met there
by its peers, which stop at that collective and unwind. Out of memory is an outcome the
profiler records (the layout does not fit); any other exception stops every rank of the
group: the failing rank re-raises its own, the others a RuntimeError naming it.

Not covered: timed runs have no per-collective agreement (it would be timed), so an
allocator failure on one rank inside a timed run — a repeat of a run that already fitted —
before the run's last collective leaves its peers in that collective until the training
group's timeout; so do FSDP2's collectives of shard blocks (`runtime.sharded`), which run
inside torch, out of the guard's reach.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from dcparallel.runtime import comm

#: a rank's status in an agreement of `run_together`: (what, message)
RUNNING, DONE, OOM, ERROR = "running", "done", "oom", "error"


class ControlGroups:
    """The control group of each SP group a profile measures: None for one rank, the world's
    `comm.control_group` for the whole world, else a gloo twin of the group's ranks with the
    control timeout. ``num_buckets``: how many buckets the profile measures; with `group_buckets`
    only the first ``num_buckets`` aligned groups of each degree get items, so only those get
    twins (a few per degree rather than world / k of them at thousands of ranks). Every rank
    creates them at once (`new_group` is collective over the world), kept for the process's
    world."""

    _twins: dict[int, dict[tuple[int, ...], object]] = {}

    def __init__(self, sp_sizes: Sequence[int], num_buckets: int | None = None):
        self.world = comm.world_size()
        self.control = comm.control_group()
        key = id(dist.group.WORLD) if self.world > 1 else 0
        if key not in self._twins:
            self._twins.clear()
            self._twins[key] = {}
        self.twins = self._twins[key]
        timeout = timedelta(seconds=comm.control_timeout_s())
        for k in sorted(set(sp_sizes)):
            if 1 < k < self.world:
                used = self.world // k if num_buckets is None else min(self.world // k, num_buckets)
                for start in range(0, used * k, k):
                    ranks = tuple(range(start, start + k))
                    if ranks not in self.twins:
                        self.twins[ranks] = dist.new_group(list(ranks), backend="gloo", timeout=timeout)

    def of(self, ranks: Sequence[int]):
        ranks = tuple(ranks)
        if len(ranks) == 1:
            return None
        if len(ranks) == self.world:
            return self.control
        return self.twins[ranks]


class PeerStopped(Exception):
    """Raised inside a run on a rank whose group agreed, before a collective, that a peer stopped."""


def _message(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return text or type(exc).__name__


def run_together(fn: Callable[[], None], group, ranks: Sequence[int], *, guarded: bool = True) -> str | None:
    """Runs ``fn()`` on every rank of ``group`` (the control group of the SP group ``ranks``,
    None for one rank) and returns the same outcome on each: None when every rank finished,
    else the first out-of-memory message. ``guarded``: also agree before each of the run's
    collectives (untimed runs). Another exception on any rank is raised on every rank."""
    seen: list[tuple[str, str]] | None = None

    def check() -> None:
        nonlocal seen
        statuses = comm.all_gather_object((RUNNING, ""), group)
        if any(s[0] != RUNNING for s in statuses):
            seen = statuses
            raise PeerStopped()

    mine, own = (DONE, ""), None
    guard = comm.collective_guard(check) if guarded and group is not None else contextlib.nullcontext()
    try:
        with guard:
            fn()
    except PeerStopped:
        if seen is None:  # not ours: a nested agreement's
            raise
    except torch.OutOfMemoryError as exc:
        mine = (OOM, _message(exc))
    except Exception as exc:  # noqa: BLE001 - told to the group, then raised on every rank
        mine, own = (ERROR, f"{type(exc).__name__}: {_message(exc)}"), exc
    if seen is None:
        seen = comm.all_gather_object(mine, group) if group is not None else [mine]
    return _outcome(seen, ranks, own)


def _outcome(seen: Sequence[tuple[str, str]], ranks: Sequence[int], own: Exception | None) -> str | None:
    errors = [(r, msg) for r, (what, msg) in zip(ranks, seen, strict=True) if what == ERROR]
    if errors:
        if own is not None:
            raise own
        r, msg = errors[0]
        raise RuntimeError(
            f"rank {r} of SP group {list(ranks)} failed while profiling ({msg}); every rank of the group stops"
        )
    oom = next((msg for what, msg in seen if what == OOM), None)
    if oom is not None:
        return oom
    if any(what == RUNNING for what, _ in seen):
        raise RuntimeError(
            f"the ranks of SP group {list(ranks)} ran different collectives in one micro-batch "
            f"(statuses {[what for what, _ in seen]}): the model's run must be the same on every "
            f"rank of a group"
        )
    return None
