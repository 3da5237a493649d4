"""The makespan targets `sample` packs a step at: the smallest that packs.

A target packs if every micro-batch fits a group finishing within it on the world's ranks.
Whether one does is not monotone in the target (a larger one changes the degrees the
micro-batches take), so the search assumes it only to find the first, among the
micro-batches' finishes, and then a smaller one below it where the degrees stay those of
the finish before; both are packed and the faster packing kept.

Short names: T (a makespan target), a / b (the ends of a bracket of targets), lo / hi /
mid (a bisection's positions), ts (the micro-batches' distinct finishing times from the floor).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from dcparallel.plan.dcp.config import DEFAULT, DcpConfig


def search_targets(
    pack: Callable[[float], object | None],
    finish: np.ndarray,
    floor: float,
    ceiling: float = math.inf,
    config: DcpConfig = DEFAULT,
) -> list[float] | None:
    """The targets to pack at (None if none up to `ceiling` packs): the smallest of the
    micro-batches' finishes that packs, and the smallest target below it found to pack.
    Finishes above the first are not packed: on the CPU-time report's cells (weak and
    strong, 256 and 1024 GPUs, tail steps included: 127 searches), the next two never
    packed faster than these.

    `pack(T)` packs at T (None where it does not; callers cache it: the same targets are
    asked again), `finish` holds every micro-batch's finish at every degree (inf where it
    does not fit), and no target below `floor` (lowered by `config.floor_slack`) packs. The
    search steps up from the floor, by `config.gallop_first` of it and then
    `config.gallop_growth` times more each step, until a target packs; bisects among the
    finishes inside that last step for the first that packs; and bisects below it (where the
    micro-batches' degrees stay those of the finish before) until the bracket is
    `config.continuous_gap` of the target narrow (at most `config.continuous_steps` steps).
    The last bisection's target is added when below the first. A few packings where the
    target is close to the floor (efficient steps), about the log of the finishes in the step
    otherwise. With a ceiling, one packing there first: where it does not pack, the search
    ends (packing assumed monotone)."""
    floor *= 1 - config.floor_slack
    ts = np.unique(finish[np.isfinite(finish) & (finish >= floor)])
    if ceiling < math.inf and pack(ceiling) is None:
        return None  # (a ceiling is a plan to beat: most often, nothing up to it packs)
    below, T = floor, floor
    for i in range(64):
        if pack(T) is not None:
            break
        if T >= ceiling:
            return None
        below, T = T, min(floor * (1 + config.gallop_first * config.gallop_growth**i), ceiling)
    else:
        return None
    inner = np.append(ts[(ts > below) & (ts < T)], T)
    lo, hi = 0, len(inner) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if pack(float(inner[mid])) is not None:
            hi = mid
        else:
            lo = mid + 1
    first = float(inner[lo])
    targets = [first]
    a, b = (float(inner[lo - 1]) if lo > 0 else below), first
    for _ in range(config.continuous_steps):
        if b - a <= b * config.continuous_gap:
            break
        mid = (a + b) / 2
        if pack(mid) is not None:
            b = mid
        else:
            a = mid
    if b < first:
        targets.append(b)
    return targets
