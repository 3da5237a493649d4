"""The planning stream: an epoch's step plans made ahead of the loader, in a thread or a planning process.

Plans are pure functions of the step, so where and when they are made cannot change them.
Two readers walk the steps in order at their own pace (the DataLoader's sampler and the step
assembler); a plan is dropped once both have passed it. Asked to (``predict``), the stream
also replays each plan on the simulator where it was made, off the training loop, and hands
the `StepPrediction` to the assembler with the plan. The planning process (`PlanWorker`)
is a fresh interpreter running `sim.plan_worker`, not a fork of the training process: that
module says why.

A loop that stops early (a `break`, an exception) closes its stream while the planner may be
busy with a step the loop will never take, and a plan of a large step can take minutes: so
closing waits at most `END_WAIT_S` for the planner to stop (a process answers between
plans), then kills a planning process (a new one starts in well under a second) or leaves a
planning thread to end after its plan. A planning process also ends, even mid-plan, when
the training process does, however it ends: its stdin is a pipe the training process holds
open and never writes (`sim.plan_worker`), so it never holds the launcher's output pipe
after the run.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from dcparallel.plan import steps as step_former
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import Planner
from dcparallel.plan.types import StepPlan
from dcparallel.sim.plan_worker import checked_plan
from dcparallel.sim.replay import StepPrediction, predict_step

Predict = Callable[[StepPlan], StepPrediction]

END_WAIT_S = 2.0
"""how long closing a stream waits for its planner to stop (plans in flight are not awaited)"""


def predictor(ctx: PlanContext) -> Predict:
    """The prediction of a plan on ``ctx`` (`sim.replay.predict_step`)."""
    return functools.partial(predict_step, ctx=ctx)


class PlanShelf:
    """The bookkeeping both plan streams keep: the plans made and not yet passed by both
    readers (the DataLoader's sampler and the step assembler, each walking the steps in order
    at its own pace), their predictions until taken, the seconds planning took and the steps
    the assembler waited for. Not locked: its stream holds its own lock around every call."""

    def __init__(self, start: int):
        self.plans: dict[int, StepPlan] = {}
        self._predicted: dict[int, StepPrediction | None] = {}
        self._pos = {"sampler": start, "assembler": start}  # the step each reader is at
        self.plan_seconds = 0.0
        #: the steps whose plan the step assembler asked for before it was there (it waited)
        self.waited: list[int] = []

    def reader_at(self, reader: str, k: int) -> None:
        """``reader`` asks for step ``k``: the plans every reader has passed are dropped."""
        self._pos[reader] = k
        keep = min(self._pos.values())
        for j in [j for j in self.plans if j < keep]:
            del self.plans[j]

    def note_wait(self, reader: str, k: int) -> None:
        """Records step ``k`` as waited for when the assembler asks for it before it is here."""
        if reader == "assembler" and k not in self.plans:
            self.waited.append(k)

    def put(self, k: int, plan: StepPlan, predicted: StepPrediction | None) -> None:
        self.plans[k], self._predicted[k] = plan, predicted

    def prediction(self, k: int) -> StepPrediction | None:
        """Plan k's prediction (None unless asked for), once."""
        return self._predicted.pop(k, None)


class PlanStream:
    """Plans the steps of one epoch in order on a background thread, `lookahead` steps ahead
    of the furthest step anyone asked for. ``lookahead=0`` plans in the caller's thread.
    ``predict``: each plan's `StepPrediction`, made with the plan (`prediction`); ``stop``:
    no step from ``stop`` on is planned (default: to the epoch's end)."""

    def __init__(
        self,
        build: Callable[[], Planner],
        steps: Sequence[step_former.Step],
        start: int,
        lookahead: int,
        name: str,
        predict: Predict | None = None,
        stop: int | None = None,
    ):
        self._build, self._steps, self._lookahead, self._name = build, steps, lookahead, name
        self._end = len(steps) if stop is None else min(stop, len(steps))  # plans no step from here on
        self._predict = predict
        self._planner: Planner | None = None
        self._cond = threading.Condition()
        self.shelf = PlanShelf(start)
        self._next = start  # next step to plan
        self._demand = start  # 1 + the furthest step asked for
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    plan_seconds = property(lambda self: self.shelf.plan_seconds)
    waited = property(lambda self: self.shelf.waited)

    def _plan(self, k: int) -> tuple[StepPlan, StepPrediction | None]:
        t0 = time.perf_counter()
        if self._planner is None:
            self._planner = self._build()
        plan = checked_plan(self._planner, self._steps[k])
        self.shelf.plan_seconds += time.perf_counter() - t0
        return plan, self._predict(plan) if self._predict is not None else None

    def get(self, k: int, reader: str) -> StepPlan:
        """Plan k (blocks until it is planned). Two readers walk the steps in order at their
        own pace, the DataLoader's sampler and the step assembler: a plan is dropped once
        both have passed it."""
        plans = self.shelf.plans
        with self._cond:
            self.shelf.reader_at(reader, k)
            self.shelf.note_wait(reader, k)
            if self._lookahead == 0:
                if k not in plans:
                    self.shelf.put(k, *self._plan(k))
                return plans[k]
            if self._thread is None:  # started lazily: after the DataLoader forked its workers
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if k not in plans and k + 1 > self._demand:
                self._demand = k + 1
                self._cond.notify_all()
            while k not in plans and self._error is None:
                self._cond.wait()
            if k in plans:
                return plans[k]
            raise RuntimeError(f"planning step {k} failed: {self._error!r}") from self._error

    def prediction(self, k: int) -> StepPrediction | None:
        """Plan k's prediction (None unless asked for), once: call after ``get(k, "assembler")``."""
        with self._cond:
            return self.shelf.prediction(k)

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
                    while not self._stop and self._next < self._end and self._next >= self._demand + self._lookahead:
                        self._cond.wait()
                    if self._stop or self._next >= self._end:
                        return
                    k = self._next
                plan, predicted = self._plan(k)
                with self._cond:
                    self.shelf.put(k, plan, predicted)
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
        if self._thread is not None:  # a daemon thread: one busy with a plan ends after it
            self._thread.join(timeout=END_WAIT_S)


class PlanWorker:
    """A planning process (`sim.plan_worker`): a fresh interpreter, not a fork of this one,
    set up once with a loader's policy, `PlanContext` and ``predict``, then planning one
    epoch at a time for a `ProcessPlanStream`. A loader keeps its idle workers for its
    next epochs; the process ends when it is closed or this process ends (its stdin, a
    pipe this process holds open, is its lifeline: `sim.plan_worker`)."""

    def __init__(self, policy: str, ctx: PlanContext, predict: bool):
        parent, child = socket.socketpair()
        # the worker module must import as it does here; the pickles it gets then find
        # their modules on the sys.path sent first
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        # its warnings pass where this process's would (rank 0 speaks: `launch.quiet_other_ranks`)
        env["DCPARALLEL_LOG_LEVEL"] = str(logging.getLogger("dcparallel").getEffectiveLevel())
        with child:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dcparallel.sim.plan_worker", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.PIPE,
                env=env,
            )
        self.conn = Connection(parent.detach())
        self._jobs = itertools.count()
        self._ready = False
        self.conn.send(list(sys.path))
        self.conn.send((policy, ctx, predict))

    def wait_ready(self) -> None:
        """Returns once the process has loaded the policy and the context (at once after the
        first time); a RuntimeError saying why if it could not."""
        if self._ready:
            return
        try:
            kind, _, *rest = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the planning process ended as it started (exit code {self.exit_code()})") from None
        if kind == "error":
            self.close()
            raise RuntimeError(
                f"the planning process could not load the loader's policy and cost model: {rest[0]}. "
                f"It imports what it gets from this process's sys.path; a class defined in the "
                f"training script cannot be imported there: pass planning='thread'"
            )
        self._ready = True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self) -> int | None:
        """The process's exit code once it has ended (waits up to 5 s for that)."""
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def observe(self, rows: list, track: bool = False) -> None:
        """Refits the process's cost model on measured micro-batches (`sim.plan_worker.refit`,
        ``track``: one step's, for its scale) before its next job; a process that is gone is
        dropped when next taken (`idle_worker`)."""
        try:
            self.conn.send(("observe", None, rows, track))
        except OSError:
            pass

    def new_job(self) -> int:
        return next(self._jobs)

    def end_job(self, jid: int, timeout: float = END_WAIT_S) -> bool:
        """Ends job ``jid`` and drops its plans still in flight; False if the worker did not
        answer in ``timeout`` seconds (busy with a plan) or is gone (then it is killed: do not
        reuse it)."""
        try:
            self.conn.send(("end", jid))
            deadline = time.monotonic() + timeout
            while self.conn.poll(max(0.0, deadline - time.monotonic())):
                msg = self.conn.recv()
                if msg[0] == "ended" and msg[1] == jid:
                    return True
        except (EOFError, OSError):
            pass
        self.close(kill=True)
        return False

    def close(self, kill: bool = False) -> None:
        """Ends the process: asks it to (it answers between plans) and waits up to 10 s, or
        with ``kill`` (busy with a plan nobody will take) kills it at once."""
        if self.proc.poll() is None and not kill:
            try:
                self.conn.send(None)
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill = True
        if self.proc.poll() is None and kill:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.conn.close()


def idle_worker(idle: list[PlanWorker], policy: str, ctx: PlanContext, predict: bool) -> PlanWorker:
    """A ready worker taken off a loader's ``idle`` list (those that ended since their last
    epoch, killed, are dropped), or a new one."""
    while idle and not idle[-1].alive():
        idle.pop().close()
    worker = idle.pop() if idle else PlanWorker(policy, ctx, predict)
    worker.wait_ready()
    return worker


def close_workers(workers: list[PlanWorker]) -> None:
    """Ends every worker of the list (a loader's idle ones, when it is collected)."""
    while workers:
        workers.pop().close()


class ProcessPlanStream:
    """`PlanStream`'s interface, the planning done by a `PlanWorker` (so that planning never
    holds the training process's interpreter lock). Plans are pure functions of the step:
    the same as in-process. On `close` the worker goes back to ``idle`` (the loader's list
    of idle workers) once it has ended this stream's job, or is closed if it did not.
    ``stop``: plan no step from ``stop`` on (default: to the epoch's end)."""

    def __init__(
        self,
        worker: PlanWorker,
        steps: Sequence[step_former.Step],
        start: int,
        lookahead: int,
        idle: list[PlanWorker],
        stop: int | None = None,
    ):
        self._worker, self._idle = worker, idle
        self._conn = worker.conn
        self._jid = worker.new_job()
        self._lock = threading.Lock()
        self._send(("job", self._jid, steps, start, lookahead, stop))
        self.shelf = PlanShelf(start)
        self._demand = start

    plan_seconds = property(lambda self: self.shelf.plan_seconds)
    waited = property(lambda self: self.shelf.waited)

    def get(self, k: int, reader: str) -> StepPlan:
        plans = self.shelf.plans
        with self._lock:
            self.shelf.reader_at(reader, k)
            while k not in plans and self._conn.poll():  # plans already sent count as arrived
                self._receive(k)
            self.shelf.note_wait(reader, k)
            if k not in plans and k + 1 > self._demand:
                self._demand = k + 1
                self._send(("demand", self._jid, self._demand))
            while k not in plans:
                self._receive(k)
            return plans[k]

    def _receive(self, k: int) -> None:
        """One message of the worker, waiting for it: a plan kept, or the error raised."""
        try:
            kind, _, *rest = self._conn.recv()  # this job's: a worker ends one job before the next
        except (EOFError, OSError):  # closed, or reset with our demand unread
            raise RuntimeError(
                f"the planning process ended before step {k} was planned (exit code {self._worker.exit_code()})"
            ) from None
        if kind == "error":
            raise RuntimeError(f"planning step {k} failed in the planning process: {rest[0]}")
        j, plan, seconds, predicted = rest
        self.shelf.put(j, plan, predicted)
        self.shelf.plan_seconds += seconds

    def prediction(self, k: int) -> StepPrediction | None:
        with self._lock:
            return self.shelf.prediction(k)

    def ahead(self, k: int) -> None:
        with self._lock:
            if k > self._demand:
                self._demand = k
                self._send(("demand", self._jid, k))

    def _send(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except OSError:
            pass  # the process is gone: `get` says so, with its exit code, when it reads the end

    def close(self) -> None:
        if self._worker.end_job(self._jid):
            self._idle.append(self._worker)
