"""Robust timing estimates for the profiler: outliers rejected by the median absolute
deviation, rounds added until the median is known well enough, the spread kept.

Pure Python (no torch), so the rules are tested with a fake timer. A round's value is the
layout's full-depth time extrapolated from that round alone (`round_estimates`); a round is
an outlier when it lies more than `k` scaled MADs (1.4826 x MAD estimates the standard
deviation of normal noise) from the median, as one stalled run on a shared machine does.
The median of the kept rounds is known to within +-`half_width` (a 95% interval of a
median from n normal samples: 1.96 x 1.2533 x sigma / sqrt(n)); the profiler stops adding
rounds once that is below `rel_tol` of the median, or at its cap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: scales a MAD to the standard deviation of normal noise
MAD_SIGMA = 1.4826
#: rounds needed before a spread says anything (one or two values always look stable)
MIN_SPREAD_ROUNDS = 3
#: 95% normal quantile x the asymptotic efficiency factor of the median (sqrt(pi / 2))
MEDIAN_CI = 1.96 * 1.2533


@dataclass(frozen=True)
class Estimate:
    """The median of the kept values, its 95% interval [`low`, `high`] and the counts."""

    value: float
    low: float
    high: float
    kept: int
    rejected: int

    @property
    def rel_half_width(self) -> float:
        """Half the interval, relative to the value (0 for a zero value)."""
        return (self.high - self.low) / 2 / self.value if self.value > 0 else 0.0


def keep_mask(xs: Sequence[float], k: float = 3.5) -> list[bool]:
    """Which values are kept: those within ``k`` scaled MADs of the median. With a zero MAD
    (most values equal) only values equal to the median are kept."""
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    return [abs(x - med) <= k * MAD_SIGMA * mad for x in xs]


def estimate(xs: Sequence[float], k: float = 3.5) -> Estimate:
    """The robust median of ``xs`` with its interval (see the module docstring)."""
    if not xs:
        raise ValueError("no values to estimate from; time at least one round")
    kept = [x for x, ok in zip(xs, keep_mask(xs, k)) if ok]
    med = statistics.median(kept)
    sigma = MAD_SIGMA * statistics.median(abs(x - med) for x in kept)
    half = MEDIAN_CI * sigma / math.sqrt(len(kept))
    return Estimate(med, max(0.0, med - half), med + half, len(kept), len(xs) - len(kept))


def round_estimates(
    t_short: Sequence[float], t_long: Sequence[float], d_short: int, d_long: int, num_layers: int
) -> list[float]:
    """Each round's full-depth time: its longer stack's time plus the remaining layers at
    the round's own per-layer time, (t_long - t_short) / (d_long - d_short)."""
    per = [(b - a) / (d_long - d_short) for a, b in zip(t_short, t_long, strict=True)]
    return [b + (num_layers - d_long) * p for b, p in zip(t_long, per)]


def timed_until_stable(
    run_round: Callable[[], float],
    *,
    min_rounds: int,
    max_rounds: int,
    rel_tol: float,
    k: float = 3.5,
    agree: Callable[[bool], bool] = lambda done: done,
) -> list[float]:
    """Calls ``run_round`` (one round's value) at least ``min_rounds`` and at most
    ``max_rounds`` times, stopping once the robust median's half-width is within ``rel_tol``
    (judged from `MIN_SPREAD_ROUNDS` rounds on: fewer show no spread).
    ``agree`` turns this process's verdict into the group's (all ranks of an SP group must run
    the same rounds: the profiler passes "every rank is done")."""
    if not 1 <= min_rounds <= max_rounds:
        raise ValueError(f"rounds: need 1 <= min_rounds <= max_rounds; got {min_rounds}, {max_rounds}")
    xs = [run_round() for _ in range(min_rounds)]
    while len(xs) < max_rounds and not agree(
        len(xs) >= MIN_SPREAD_ROUNDS and estimate(xs, k).rel_half_width <= rel_tol
    ):
        xs.append(run_round())
    return xs


def summarize_rounds(times: dict[int, list[float]], depths: Sequence[int], xs: Sequence[float], k: float = 3.5) -> dict:
    """A layout's timing from its rounds: the outlier rounds (by their full-depth estimates
    ``xs``) dropped from every depth, then per depth the median time, the median per-layer
    time of the two depths ``depths`` (per round), and the spread, rounds and rejected."""
    keep = keep_mask(xs, k)
    kept = {d: [t for t, ok in zip(ts, keep) if ok] for d, ts in times.items()}
    a, b = depths
    est = estimate(xs, k)
    return {
        "time": {d: statistics.median(ts) for d, ts in kept.items()},
        "slope": statistics.median((y - x) / (b - a) for x, y in zip(kept[a], kept[b], strict=True)),
        "spread": est.rel_half_width,
        "rounds": len(xs),
        "rejected": est.rejected,
    }
