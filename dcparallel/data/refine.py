"""The loader's online refinement: micro-batch times measured in the first steps of training
correct the cost model (`cost.refined.RefinedCost`) that plans the later steps; with a
CPU-calibrated analytic model every later step's times keep its scale current (`track_steps`).

What is fed: per micro-batch of a step, its samples' sizes, its SP degree, its recompute
setting and the seconds it took on the lowest rank of its group. Every rank gathers every
rank's times (`step_rows`, one `all_gather_object` per refined step), so every rank, and
every planning process, refits on the same rows in the same order (`sim.plan_worker.refit`):
the plans stay identical across ranks. A row is plain data (lists and numbers) so that it
travels in a loader's `state_dict` and over a planning process's connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from dcparallel.cost.refined import RefinedCost
from dcparallel.plan.types import StepPlan
from dcparallel.runtime import comm
from dcparallel.sim.plan_worker import refit
from dcparallel.spec import Size

log = logging.getLogger(__name__)

#: (sizes, sp, recompute attention layers, recompute MLP layers, seconds); a video size is a list
Row = tuple[list, int, int, int, float]


#: steps whose median ratio of measured to priced seconds scales a CPU-calibrated model's prices
TRACK_STEPS = 3


def track_steps(cost: Any) -> int:
    """`TRACK_STEPS` for a cost model priced at a launch's timed slowdown (``launch_slowdown``:
    the CPU's analytic calibration, `profile.cpu_calibration.analytic_cost`), whose wall seconds
    per processor second move with the machine's load; else 0 (a GPU's prices, a profile)."""
    return TRACK_STEPS if getattr(cost, "launch_slowdown", None) else 0


def wrapped(cost: Any, refine_steps: int, track: int) -> Any:
    """``cost`` in a `RefinedCost` (scaled over ``track`` steps) when it is refined or tracked."""
    refined = (refine_steps or track) and not isinstance(cost, RefinedCost)
    return RefinedCost(cost, track) if refined else cost


def check_steps(refine_steps: int) -> int:
    """``refine_steps``, checked (an int >= 0)."""
    if isinstance(refine_steps, bool) or not isinstance(refine_steps, int) or refine_steps < 0:
        raise ValueError(f"refine_steps must be an integer >= 0 (0: no refinement); got {refine_steps!r}")
    return refine_steps


def seconds_since(start: float, device: Any, sync: bool) -> float:
    """The seconds of the micro-batch begun at ``start`` (a `time.perf_counter`): on a CUDA
    ``device`` with ``sync`` (while steps remain to refine) it first waits for the device,
    so that the time is the micro-batch's, not its launch's."""
    if sync and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def step_rows(plan: StepPlan, rank: int, world_size: int, sizes: Sequence[Size], seconds: Sequence[float]) -> list[Row]:
    """The rows of one step, the same on every rank: ``seconds`` are this rank's times of its
    micro-batches (`plan.work_of(rank)`'s order), gathered over the world."""
    work = plan.work_of(rank)
    if len(seconds) != len(work):
        raise ValueError(
            f"rank {rank} ran {len(work)} micro-batch(es) in step {plan.index} but {len(seconds)} "
            f"time(s) were given: give one time per batch of the step, in order"
        )
    times = comm.all_gather_object([float(s) for s in seconds]) if world_size > 1 else [[float(s) for s in seconds]]
    rows: list[Row] = []
    for r in range(world_size):
        for (mb, ranks), s in zip(plan.work_of(r), times[r], strict=True):
            if r == min(ranks):
                lay = mb.layout
                rows.append(
                    ([_plain(sizes[i]) for i in mb.sample_ids], lay.sp, lay.recompute.attn, lay.recompute.mlp, s)
                )
    return rows


def feed(loader, rows: Sequence[Row], count: bool = True, track: bool = False) -> None:
    """``loader`` (a `DataCentricLoader`) refits on ``rows``, as do its idle planning processes
    (the next job of each plans on the new fit); ``count``: they end one of the steps to
    refine. Rank 0 logs the fits once the last step is fed. ``track``: ``rows`` are one
    step's, after the steps to refine, for the cost model's scale (`RefinedCost.observe_step`);
    not saved (a resumed run starts from its launch's slowdown again)."""
    loader.context = refit(loader.context, rows, track)
    for worker in loader.idle_workers:
        worker.observe(list(rows), track)
    if track:
        cost = loader.context.cost
        log.debug("rank %d: the machine runs at %.3g x the prices made at launch", loader.rank, cost.scale)
        return
    loader.refined.extend(rows)
    loader.refine_left -= int(count)
    if count and not loader.refine_left and loader.rank == 0:
        cost = loader.context.cost
        fits = ", ".join(
            f"SP {k}: {a:.3g} x price + {b * 1e3:.3g} ms"
            for k in loader.context.sp_sizes
            if k in cost.fitted
            for a, b in [cost.correction(k)]
        )
        log.info(
            "the cost model is refined on %d measured micro-batches (%s); later steps are planned with it",
            len(loader.refined),
            fits or "none",
        )


def _plain(size: Size) -> int | list[int]:
    return list(size) if isinstance(size, tuple) else int(size)
