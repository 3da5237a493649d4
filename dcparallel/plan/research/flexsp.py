"""`flexsp`: FlexSP-style optimal assignment, reproduced from its published description (no
code of theirs), as a policy of the same simulator.

FlexSP (Wang et al., "FlexSP: Accelerating Large Language Model Training via Flexible
Sequence Parallelism", ASPLOS 2025) forms, per step, heterogeneous SP groups (sizes from
powers of two) over the cluster and assigns the step's sequences to them with a
mixed-integer linear program that minimizes the slowest group's time, under each group's
memory; sequences are bucketed by length to keep the program small, and the solver runs
under a limit. Here:

- **buckets**: the context's (`PlanContext.bucket_of`), each timed as its largest sample, so
  a micro-batch of m samples of bucket b at SP degree k takes t(b, k, m) (copies of that
  sample; recompute "fit", the fastest whole-model setting that fits, as for the other
  peers), m over 1, 2, 4, ... and the most that fit (every count is a sum of those);
- **the program**: group *slots* (up to world / k per degree k of the chain; open slots'
  sizes sum to at most the world and, being chain sizes, tile it as aligned blocks), integer
  counts of micro-batches of each (b, m) per slot, every sample exactly once, each slot's
  load at most the makespan C; minimize C (HiGHS through `scipy.optimize.milp`);
- **the limit**: `NODE_LIMIT` branch-and-bound nodes and no wall clock: every rank plans on
  its own, so a step's plan must not depend on how fast a rank solved it (``time_limit=`` is
  for offline comparisons only); the best solution found is used. Where the solver finds
  none, the step is planned by a simple fallback (each sample alone at the narrowest degree
  every sample fits, longest first to the least-loaded group) and counted in `describe()`.

The program grows with slots x buckets x micro-batch sizes, so this policy runs only where it
solves in time: clusters of at most `MAX_WORLD` GPUs (the scale report runs it at 8 and 32).
One phase: groups do not change within a step.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import numpy as np

from dcparallel.plan.assemble import assemble, lpt
from dcparallel.plan.context import PlanContext, mbs_candidates
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan

#: branch-and-bound nodes per step: the limit of a training run's plans (deterministic)
NODE_LIMIT = 2000
#: relative optimality gap at which the solver stops
MIP_GAP = 1e-4
#: the largest cluster it plans for: the program has about 2 x world slots, and at 32 GPUs it
#: already stops at its limit on most steps
MAX_WORLD = 64


class FlexSPPlanner:
    name = "flexsp"

    def __init__(self, ctx: PlanContext, node_limit: int = NODE_LIMIT, time_limit: float | None = None):
        self.ctx = ctx
        self.world = ctx.cluster.world_size
        if self.world > MAX_WORLD:
            raise ValueError(
                f"flexsp solves a MILP per step whose size grows with the world; it plans for at most "
                f"{MAX_WORLD} GPUs (got {self.world}): compare it on a smaller cluster"
            )
        self.node_limit, self.time_limit = node_limit, time_limit
        self.mode = "fit"
        self._times: dict = {}
        #: per step planned: the solver's status ("optimal", "limit", "fallback")
        self.outcomes: dict[str, int] = {}

    def describe(self) -> dict:
        return {
            "recompute": self.mode,
            "solver": "HiGHS MILP",
            "node_limit": self.node_limit,
            "time_limit_s": self.time_limit,
            "outcomes": dict(self.outcomes),
        }

    def _options(self, b, k: int, count: int) -> list[tuple[int, float]]:
        """(m, t(b, k, m)) for the micro-batch sizes of bucket b at degree k: powers of two up
        to the most that fit, and that most (`mbs_candidates`), at most the step's count; timed
        as copies of the bucket's largest sample."""
        key = (b, k)
        hit = self._times.get(key)
        if hit is None:
            rep, ctx = self.ctx.rep[b], self.ctx
            top = ctx.max_mbs(rep, k, self.mode)
            hit = self._times[key] = (
                [(m, ctx.copies_layout(rep, m, k, self.mode).time) for m in mbs_candidates(top)] if top else []
            )
        return [(m, t) for m, t in hit if m <= count]

    def plan(self, step: Step) -> StepPlan:
        ctx = self.ctx
        by_b: dict = {}
        for i in step.sample_ids:
            by_b.setdefault(ctx.bucket_of[i], []).append(i)
        buckets = sorted(by_b)
        got = self._solve(buckets, {b: len(by_b[b]) for b in buckets})
        if got is None:
            self.outcomes["fallback"] = self.outcomes.get("fallback", 0) + 1
            return self._fallback(step)
        status, slots = got
        self.outcomes[status] = self.outcomes.get(status, 0) + 1
        # each bucket's samples, longest first, cut into the micro-batches the slots run
        queue = {b: sorted(ids, key=lambda i: (-ctx.tokens[i], i)) for b, ids in by_b.items()}
        taken = dict.fromkeys(queue, 0)
        groups = []
        for k, work in sorted(slots, key=lambda s: -s[0]):
            mbs = []
            for b, m, n in work:
                for _ in range(n):
                    ids = tuple(queue[b][taken[b] : taken[b] + m])
                    taken[b] += m
                    fit = ctx.layout_for(tuple(ctx.sizes[i] for i in ids), k, self.mode)
                    mbs.append((fit.time, MicroBatch(ids, fit.layout)))
            mbs.sort(key=lambda x: x[0])  # shortest first, as the other planners run them
            groups.append((k, tuple(mb for _, mb in mbs)))
        assert all(taken[b] == len(ids) for b, ids in queue.items()), "every sample is planned once"
        ranks = ctx.topology.tile([k for k, _ in groups])
        return assemble(ctx, step, [GroupPlan(r, mbs) for r, (_, mbs) in zip(ranks, groups)])

    def _solve(self, buckets: list, counts: dict) -> tuple[str, list] | None:
        """The program of the module docstring. Returns (status, [(k, [(bucket, m, n)])] per
        open slot), or None if the solver found no solution."""
        res, var, slots = slot_program(
            self.world,
            self.ctx.sp_sizes,
            buckets,
            counts,
            lambda b, k: self._options(b, k, counts[b]),
            gap=MIP_GAP,
            time_limit=self.time_limit,
            node_limit=self.node_limit,
        )
        if res.x is None:
            return None
        x = np.rint(res.x[: len(var)]).astype(int)
        out: dict[int, list] = {}
        for (s, b, m, _), c in zip(var, x.tolist()):
            if c:
                out.setdefault(s, []).append((b, m, c))
        return ("optimal" if res.status == 0 else "limit"), [(slots[s], out[s]) for s in sorted(out)]

    def _fallback(self, step: Step) -> StepPlan:
        """Each sample alone, at the narrowest degree every sample of the step fits, longest
        first to the least-loaded group."""
        ctx = self.ctx
        ids = list(step.sample_ids)
        k = next(k for k in ctx.sp_sizes if all(ctx.copies_layout(ctx.sizes[i], 1, k, self.mode) for i in ids))
        fits = [ctx.copies_layout(ctx.sizes[i], 1, k, self.mode) for i in ids]
        assign, _ = lpt([f.time for f in fits], self.world // k)
        ranks = ctx.topology.tile([k] * (self.world // k))
        return assemble(
            ctx,
            step,
            [
                GroupPlan(
                    r, tuple(MicroBatch((ids[j],), fits[j].layout) for j in sorted(a, key=lambda j: (fits[j].time, j)))
                )
                for r, a in zip(ranks, assign)
            ],
        )


def slot_program(
    world: int,
    sp_sizes: list[int],
    buckets: list,
    counts: dict,
    options,
    *,
    gap: float,
    time_limit: float | None,
    node_limit: int | None = None,
):
    """The least makespan over group slots (world / k of each degree k; open slots' sizes sum
    to at most the world) and integer counts of micro-batches per slot: `options(b, k)` lists
    (m, seconds) of a micro-batch of m samples of bucket b at degree k; every bucket's
    `counts[b]` samples exactly once; each slot's load at most the makespan, which is
    minimized (HiGHS through `scipy.optimize.milp`). Returns scipy's result, the micro-batch
    variables as (slot, bucket, m, seconds), in the result's order, and the slots' degrees."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # (scipy loads only when a program is solved)

    slots = [k for k in sp_sizes for _ in range(world // k)]
    var = []  # (slot, bucket, m, t)
    for s, k in enumerate(slots):
        for b in buckets:
            var.extend((s, b, m, t) for m, t in options(b, k))
    A, lo, hi = _constraints(world, slots, var, buckets, counts)
    nx, ns = len(var), len(slots)
    n = nx + ns + 1  # x..., u (slot open)..., C
    cost = np.zeros(n)
    cost[-1] = 1.0
    ub = np.concatenate([[counts[v[1]] // v[2] for v in var], np.ones(ns), [np.inf]])
    integrality = np.concatenate([np.ones(nx + ns), [0]])
    limits: dict[str, float] = {"mip_rel_gap": gap}
    if time_limit is not None:  # a wall clock makes the result depend on the machine's speed
        limits["time_limit"] = time_limit
    if node_limit is not None:
        limits["node_limit"] = node_limit
    with c_stdout_to_stderr():
        res = milp(
            cost,
            constraints=LinearConstraint(A, lo, hi),
            integrality=integrality,
            bounds=Bounds(np.zeros(n), ub),
            options=limits,
        )
    return res, var, slots


def _constraints(world: int, slots: list[int], var: list, buckets: list, counts: dict):
    """`slot_program`'s rows as a sparse matrix (CSR) with their lower and upper bounds, over
    the variables x (one per `var` entry: micro-batches of m samples of bucket b on a slot),
    u (one per slot: the slot is open) and C (the makespan), in that order."""
    from scipy.sparse import coo_matrix

    nx, ns = len(var), len(slots)
    n = nx + ns + 1
    xs = np.arange(nx)
    vs = np.array([v[0] for v in var], dtype=int)
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(r, c, v):
        rows.append(np.asarray(r) + len(lo)), cols.append(np.asarray(c)), vals.append(np.asarray(v, float))

    bpos = {b: j for j, b in enumerate(buckets)}
    add([bpos[v[1]] for v in var], xs, [v[2] for v in var])  # every sample once
    lo += [counts[b] for b in buckets]
    hi += [counts[b] for b in buckets]
    add(vs, xs, [v[3] for v in var])  # a slot's load <= C
    add(np.arange(ns), np.full(ns, n - 1), -np.ones(ns))
    lo += [-np.inf] * ns
    hi += [0.0] * ns
    add(vs, xs, np.ones(nx))  # only open slots run micro-batches
    add(np.arange(ns), nx + np.arange(ns), -float(sum(counts.values())) * np.ones(ns))
    lo += [-np.inf] * ns
    hi += [0.0] * ns
    add(np.zeros(ns, dtype=int), nx + np.arange(ns), slots)  # open slots fit the world
    lo.append(0.0)
    hi.append(float(world))
    same = [s for s in range(1, ns) if slots[s] == slots[s - 1]]  # a degree's slots open in order
    add(np.arange(len(same)), nx + np.array(same, dtype=int), np.ones(len(same)))
    add(np.arange(len(same)), nx + np.array(same, dtype=int) - 1, -np.ones(len(same)))
    lo += [-np.inf] * len(same)
    hi += [0.0] * len(same)
    A = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(lo), n))
    return A.tocsr(), lo, hi


@contextlib.contextmanager
def c_stdout_to_stderr():
    """Within the block, what C code writes to the process's stdout (file descriptor 1) goes to
    stderr: HiGHS at times prints a line from inside a MIP solve whatever its output options
    say, which would break the JSON lines of `dcparallel plan --json` and the like. C's own
    stdout buffer is flushed before fd 1 is restored, so buffered text goes to stderr too.
    Python's `sys.stdout` is flushed on entry and is not to be written within the block; fd 1
    is the whole process's, so what other threads write to stdout meanwhile goes to stderr too."""
    try:
        libc = ctypes.CDLL(None)
        fflush = libc.fflush
    except (OSError, AttributeError, TypeError):  # no C library to flush (not POSIX): leave fd 1 as is
        yield
        return
    sys.stdout.flush()
    fflush(None)
    try:
        saved = os.dup(1)
    except OSError:  # fd 1 is closed: nothing to keep clean
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
