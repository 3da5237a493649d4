"""A floor under a static baseline's plan of a video step (`StaticFloor`): no plan of `bucket`
or `packed` at its SP degree and recompute setting is predicted faster, so the `dcp`
portfolio skips planning it where the plan it keeps is already faster (`dcp/static.py`).

A video micro-batch of these baselines holds samples of one class (one latent grid, which
sets a sample's cost: copies of the class's `PlanContext.rep` price each member), at most
`most(b)` of them, and the baseline deals its micro-batches to the world's data-parallel
groups of its degree. So its compute is at least:

- the step's work over the groups: each sample at its class's least time per copy (over 1 to
  `most(b)` copies at the baseline's degree and recompute; past `PRICED` copies also the
  least of any recompute, `PlanContext.fewest_gpu_seconds`), summed, over the groups;
- its longest micro-batch: each class's first micro-batch holds min(count, `most(b)`) copies
  (`bucket` fills micro-batches of its size in data order; `packed`'s first-fit bin of one
  class holds as many as its capacity takes, cut where memory ends).

The floor is that compute plus the sync it cannot hide (as `bounds.LowerBound.with_sync`).
Text baselines mix lengths in a micro-batch, which these tables do not price: no floor.

Short names: b (a class), j (its position in `PlanContext.bucket_positions`), n (its count).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import Step

#: copies priced one by one at the baseline's recompute setting (more: `fewest_gpu_seconds`)
PRICED = 256
#: the floor is lowered by this fraction, far above the rounding of its sums
SLACK = 1e-9


class StaticFloor:
    """The floor of one static planner's plans (`__call__`) at degree `sp` and recompute
    `mode`, over `groups` data-parallel groups, its micro-batches of class b at most `most(b)`
    copies; per class its least time per copy and its times of 1.. copies, built for the
    classes a step is the first to hold, all in one grid (`price`)."""

    def __init__(self, ctx: PlanContext, sp: int, mode: str, groups: int, most: Callable[[tuple], int]):
        self.ctx, self.sp, self.mode, self.groups, self.most = ctx, sp, mode, groups, most
        self.video = ctx.model.kind == "video"
        #: per class priced: its least time per copy, its times of 1.. copies, `most(b)`
        self._tables: dict[tuple, tuple[float, np.ndarray, int]] = {}
        self._bound = LowerBound(ctx)  # its `with_sync`: a step bound from a compute bound

    def table(self, b: tuple) -> tuple[float, np.ndarray]:
        """Class b's least time per copy and its times of 1 .. min(`most(b)`, `PRICED`) copies."""
        if b not in self._tables:
            self.price([b])
        return self._tables[b][:2]

    def price(self, classes: list[tuple]) -> None:
        """Builds the tables of those of `classes` not yet priced, all in one grid
        (`PlanContext.copies_times` prices many sizes at once). With a call per class, `bucket`'s
        and `packed`'s floors took 67-86 ms of CPU on the first step to hold its classes, weak
        1024-GPU opensora-stage3's 1/8 tail of 1,798 clips; with one grid each, 12 ms."""
        new = [b for b in dict.fromkeys(classes) if b not in self._tables]
        if not new:
            return
        ctx = self.ctx
        tops = [self.most(b) for b in new]
        grids = ctx.copies_times([ctx.rep[b] for b in new], [min(top, PRICED) for top in tops], self.sp, self.mode)
        for b, top, times in zip(new, tops, grids):
            per = float(np.min(times / np.arange(1, len(times) + 1)))
            if top > PRICED:
                per = min(per, ctx.fewest_gpu_seconds(ctx.rep[b], self.sp, top) / self.sp)
            self._tables[b] = (per, times, top)

    def __call__(self, step: Step) -> float:
        """No plan of the step by this planner is predicted below this (0.0 for text)."""
        if not self.video or not step.sample_ids:
            return 0.0
        keys, at = self.ctx.bucket_positions()
        counts = np.bincount(at[np.asarray(step.sample_ids, dtype=np.int64)], minlength=len(keys))
        held = counts.nonzero()[0].tolist()
        self.price([keys[j] for j in held])
        work = longest = 0.0
        for j in held:
            b, n = keys[j], int(counts[j])
            per, times, top = self._tables[b]  # `most(b)` kept: `packed`'s bisects memory
            work += n * per
            first = min(n, top)
            if first <= len(times):
                longest = max(longest, float(times[first - 1]))
        return self._bound.with_sync(max(work / self.groups, longest) * (1 - SLACK))
