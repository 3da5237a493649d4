"""The warm-ups and timed rounds of one layout, run by every rank of its SP group alike.

Each timed round runs every measured depth once, back to back (`profile.robust`); the group
agrees on the number of rounds (from the slowest rank's first runs), on each round's outcome
(`control.run_together`, without the per-collective agreement, which would be timed) and on
when the median is stable, so its ranks run the same rounds and collectives.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from dcparallel.profile.config import ProfilerConfig
from dcparallel.profile.control import run_together
from dcparallel.profile.drift import ReferenceClock
from dcparallel.profile.measure import Timer
from dcparallel.profile.robust import round_estimates, summarize_rounds, timed_until_stable
from dcparallel.runtime import comm


class _RoundOutOfMemory(Exception):
    """A timed round ran out of memory on some rank of the group (the group's agreed message)."""


def timed_rounds(
    at_depth: Callable[[int], AbstractContextManager],
    run: Callable[[], None],
    depths: Sequence[int],
    took: dict[int, float],
    *,
    config: ProfilerConfig,
    num_layers: int,
    timer: Timer,
    group,
    ranks: Sequence[int],
    clock: ReferenceClock | None = None,
) -> dict | str:
    """The timing of a layout whose depths ``depths`` each ran once in ``took`` seconds:
    ``run()`` runs one micro-batch, inside ``at_depth(d)`` of the ``d``-layer stack. Warm-ups (``warmup - 1``
    per depth), then >= `repeats` rounds, more while short (`min_time_s`), then until the
    median is stable. The timing summary (`robust.summarize_rounds`, plus ``reference_s``
    with a ``clock``), or the out-of-memory message that stopped it, the same on every rank."""
    cfg = config
    round_s = max(comm.all_gather_object(sum(took[d] for d in depths), group))
    rounds = min(cfg.max_repeats, max(cfg.repeats, math.ceil(cfg.min_time_s / max(round_s, 1e-9))))
    times: dict[int, list[float]] = {d: [] for d in depths}
    mark = clock.mark() if clock else 0

    def timed_round() -> None:
        for d in depths:
            with at_depth(d):
                times[d].append(timer.time(run))
        if clock:
            clock.tick()

    def one_round() -> float:
        err = run_together(timed_round, group, ranks, guarded=False)
        if err:
            raise _RoundOutOfMemory(err)
        return round_estimates(times[depths[0]][-1:], times[depths[1]][-1:], *depths[:2], num_layers)[0]

    gc.disable()  # as timeit does: no collection pauses inside a timed run
    try:
        for d in depths:
            for _ in range(cfg.warmup - 1):
                with at_depth(d):
                    err = run_together(run, group, ranks)
                if err:
                    return err
        xs = timed_until_stable(
            one_round,
            min_rounds=rounds,
            max_rounds=max(rounds, cfg.max_repeats),
            rel_tol=cfg.rel_tol,
            k=cfg.outlier_k,
            agree=lambda done: all(comm.all_gather_object(done, group)),
        )
    except _RoundOutOfMemory as exc:  # a device allocator can still fail here
        return str(exc)
    finally:
        gc.enable()
    out = summarize_rounds(times, depths[:2], xs, cfg.outlier_k)
    if clock:
        out["reference_s"] = clock.since(mark)
    return out
