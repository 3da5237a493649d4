"""The planning stream: an epoch's step plans made ahead of the loader, in a thread or a forked process.

Plans are pure functions of the step, so where and when they are made cannot change them.
Two readers walk the steps in order at their own pace (the DataLoader's sampler and the step
assembler); a plan is dropped once both have passed it. Asked to (``predict``), the stream
also replays each plan on the simulator where it was made, off the training loop, and hands
the `StepPrediction` to the assembler with the plan.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dcparallel.plan import steps as step_former
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import Planner
from dcparallel.plan.types import StepPlan
from dcparallel.sim.replay import replay_step


@dataclass(frozen=True)
class StepPrediction:
    """The simulator's replay of one whole step plan on the loader's cost model."""

    compute_s: float
    """when the last rank is done with its micro-batches"""
    step_s: float
    """``compute_s`` plus the part of the gradient sync the last backward cannot hide"""
    peak_memory_bytes: float
    """the peak memory of the step's largest micro-batch"""


Predict = Callable[[StepPlan], StepPrediction]


def predictor(ctx: PlanContext) -> Predict:
    """The prediction of a plan on ``ctx`` (`sim.replay.replay_step`)."""
    def predict(plan: StepPlan) -> StepPrediction:
        r = replay_step(plan, ctx)
        return StepPrediction(r.compute_time, r.step_time, r.peak_memory)

    return predict


class PlanStream:
    """Plans the steps of one epoch in order on a background thread, `lookahead` steps ahead
    of the furthest step anyone asked for. ``lookahead=0`` plans in the caller's thread.
    ``predict``: each plan's `StepPrediction`, made with the plan (`prediction`)."""

    def __init__(self, build: Callable[[], Planner], steps: Sequence[step_former.Step], start: int,
                 lookahead: int, name: str, predict: Predict | None = None):
        self._build, self._steps, self._lookahead, self._name = build, steps, lookahead, name
        self._predict = predict
        self._planner: Planner | None = None
        self._cond = threading.Condition()
        self._plans: dict[int, StepPlan] = {}
        self._predicted: dict[int, StepPrediction | None] = {}
        self._next = start  # next step to plan
        self._demand = start  # 1 + the furthest step asked for
        self._pos = {"sampler": start, "assembler": start}  # the step each reader is at
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.plan_seconds = 0.0

    def _plan(self, k: int) -> tuple[StepPlan, StepPrediction | None]:
        t0 = time.perf_counter()
        if self._planner is None:
            self._planner = self._build()
        plan = self._planner.plan(self._steps[k])
        assert plan.sample_ids == self._steps[k].sample_ids, "the planner changed the step's samples"
        self.plan_seconds += time.perf_counter() - t0
        return plan, self._predict(plan) if self._predict is not None else None

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
                    self._plans[k], self._predicted[k] = self._plan(k)
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

    def prediction(self, k: int) -> StepPrediction | None:
        """Plan k's prediction (None unless asked for), once: call after ``get(k, "assembler")``."""
        with self._cond:
            return self._predicted.pop(k, None)

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
                plan, predicted = self._plan(k)
                with self._cond:
                    self._plans[k], self._predicted[k] = plan, predicted
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
                       start: int, lookahead: int, predict: Predict | None) -> None:
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
            seconds = time.perf_counter() - t0
            conn.send(("plan", nxt, plan, seconds, predict(plan) if predict is not None else None))
            nxt += 1
        while conn.recv() is not None:  # wait for the loader to close
            pass
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
        try:
            conn.send(("error", -1, f"{type(e).__name__}: {e}", 0.0, None))
        except (BrokenPipeError, OSError):
            pass


class ProcessPlanStream:
    """`PlanStream`'s interface, the planning done by a child process (forked when the epoch's
    iteration starts, like the DataLoader's workers), so that planning never holds the training
    process's interpreter lock. Plans are pure functions of the step: the same as in-process."""

    def __init__(self, build: Callable[[], Planner], steps: Sequence[step_former.Step], start: int,
                 lookahead: int, name: str, predict: Predict | None = None):
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_plan_process_main,
                                 args=(child, self._conn, build, steps, start, max(1, lookahead), predict),
                                 name=name,
                                 daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._plans: dict[int, StepPlan] = {}
        self._predicted: dict[int, StepPrediction | None] = {}
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
                    kind, j, plan, seconds, predicted = self._conn.recv()
                except EOFError:
                    raise RuntimeError(f"the planning process ended before step {k} was planned "
                                       f"(exit code {self._proc.exitcode})") from None
                if kind == "error":
                    raise RuntimeError(f"planning step {k} failed in the planning process: {plan}")
                self._plans[j], self._predicted[j] = plan, predicted
                self.plan_seconds += seconds
            return self._plans[k]

    def prediction(self, k: int) -> StepPrediction | None:
        with self._lock:
            return self._predicted.pop(k, None)

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
