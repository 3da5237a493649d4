"""The planning process of a loader: ``python -m dcparallel.sim.plan_worker FD``.

A fresh interpreter, not a fork of the training process: a training process runs threads
of its own (W&B's, OpenTelemetry's, TensorBoard's writer, tqdm's monitor) and their
at-fork hooks start more of them in a forked child, so a fork of it may deadlock on a
lock one of those threads held. This module is pure core (no torch), so the process
starts in well under a second; the loader starts one when it first plans ahead and keeps
it for its later epochs (`data.plan_stream.PlanWorker`).

Protocol, on the connection ``FD`` (a `multiprocessing.connection.Connection`):

- in: the training process's ``sys.path``, then ``(policy, PlanContext, predict)`` once
  (answered ``("ready", None)``, or ``("error", None, text)`` and the end);
  then per epoch ``("job", jid, steps, start, lookahead[, stop])`` (steps ``start ..
  stop - 1``), ``("demand", jid, k)`` (plan up to step ``k - 1 + lookahead``), ``("end",
  jid)``; ``("observe", None, rows[, track])`` refits the context's `RefinedCost` on measured
  micro-batches (`refit`; the loader sends it between jobs); None or EOF ends the process.
- out: ``("plan", jid, k, StepPlan, seconds, prediction)`` in step order (prediction:
  the plan's `sim.replay.StepPrediction`, or None), ``("error", jid,
  text)`` once a job fails, ``("ended", jid)`` as the answer to ``("end", jid)``: nothing
  of that job follows it.
- stdin: a pipe the training process holds open and never writes; its end (the training
  process ended, however: killed, or exiting without closing its loader) ends this
  process at once, even in the middle of a plan of minutes.
- $DCPARALLEL_LOG_LEVEL: the level of the training process's ``dcparallel`` logger, which
  this process's takes: a rank that passes errors only (`runtime.launch.quiet_other_ranks`)
  has a planner that does too, so a warning of the cost model reaches stderr once, from
  rank 0's planner, not once per rank.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

from dcparallel.cost.refined import RefinedCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import Planner, make_planner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import StepPlan
from dcparallel.sim.replay import predict_step, step_seconds
from dcparallel.spec import Recompute


def checked_plan(planner: Planner, step: Step) -> StepPlan:
    """The planner's plan of ``step``; an error if it changed the step's samples, or if its
    micro-batches leave one out or hold one twice (`StepPlan.check_samples`: a step is not
    trained on less, or more, than its samples)."""
    plan = planner.plan(step)
    if plan.sample_ids != step.sample_ids:
        raise AssertionError(f"the planner changed the samples of step {step.index}")
    plan.check_samples()
    return plan


def refit(ctx: PlanContext, rows, track: bool = False) -> PlanContext:
    """A new context over ``ctx``'s `RefinedCost` after observing ``rows`` (`data.refine.Row`:
    sizes, sp, recompute attention and MLP layers, seconds): its affine fits, or with
    ``track`` its scale (`RefinedCost.observe_step`: ``rows`` are one step's); a context
    keeps the prices it has seen, so the plans after a refit need a new one."""
    cost = ctx.cost
    if not isinstance(cost, RefinedCost):
        raise TypeError(f"refining needs the context's cost model to be a RefinedCost; got {type(cost).__name__}")
    seen = [
        ([tuple(s) if isinstance(s, list) else s for s in sizes], sp, Recompute(attn, mlp), seconds)
        for sizes, sp, attn, mlp, seconds in rows
    ]
    if track:
        cost.observe_step(seen)
    else:
        for row in seen:
            cost.observe(*row)
    return PlanContext(ctx.workload, cost, ctx.cluster, skip_oversize=bool(ctx.skipped))


class _Job:
    def __init__(self, jid: int, steps, start: int, lookahead: int, stop: int | None = None):
        self.jid, self.steps, self.next, self.demand, self.lookahead = jid, steps, start, start, max(1, lookahead)
        self.stop = len(steps) if stop is None else min(stop, len(steps))
        self.planner = None
        self.failed = False

    def wants_more(self) -> bool:
        return not self.failed and self.next < self.stop and self.next < self.demand + self.lookahead


def serve(conn: Connection) -> None:
    """Answers the training process until it sends None or closes the connection."""
    sys.path[:] = conn.recv()  # where the training process imports from: the pickles below need it
    try:
        policy, ctx, predict = conn.recv()
    except Exception as e:  # noqa: BLE001 - e.g. a class of the training script's __main__
        conn.send(("error", None, f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    job: _Job | None = None
    while True:
        if job is None or not job.wants_more() or conn.poll():
            msg = conn.recv()
            if msg is None:
                return
            kind, jid = msg[0], msg[1]
            if kind == "job":
                job = _Job(jid, *msg[2:])
            elif kind == "demand" and job is not None and job.jid == jid:
                job.demand = max(job.demand, msg[2])
            elif kind == "observe":  # between jobs: the next job plans on the refitted context
                ctx = refit(ctx, *msg[2:])
            elif kind == "end":
                job = None
                conn.send(("ended", jid))
            continue
        k = job.next
        try:
            t0 = time.perf_counter()
            if job.planner is None:
                job.planner = make_planner(policy, ctx, job.steps, score=step_seconds(ctx))
            plan = checked_plan(job.planner, job.steps[k])
            seconds = time.perf_counter() - t0
            predicted = predict_step(plan, ctx) if predict else None
        except Exception as e:  # noqa: BLE001 - handed to the training process
            job.failed = True
            conn.send(("error", job.jid, f"{type(e).__name__}: {e}"))
            continue
        conn.send(("plan", job.jid, k, plan, seconds, predicted))
        job.next = k + 1


def exit_with_parent() -> None:
    """Blocks until stdin ends (the training process is gone), then ends this process."""
    while os.read(0, 4096):  # the fd itself: sys.stdin's reader would hold its lock at interpreter exit
        pass
    os._exit(0)


if __name__ == "__main__":
    if level := os.environ.get("DCPARALLEL_LOG_LEVEL"):
        logging.getLogger("dcparallel").setLevel(int(level))
    threading.Thread(target=exit_with_parent, name="dcparallel-lifeline", daemon=True).start()
    try:
        serve(Connection(int(sys.argv[1])))
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the training process ended: so does its planner
