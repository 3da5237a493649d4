"""`RefinedCost`: a cost model corrected online by the micro-batch times training measures.

A coarse profile (or the analytic model) prices a micro-batch at ``t``; training then runs
micro-batches and times them. Per SP degree k, the correction is affine in the price,

    t' = a_k t + b_k        (a_k > 0, b_k >= 0)

fitted by least squares of the relative error over the last `WINDOW` micro-batches measured
at that degree (`observe`; a degree not measured yet takes the fit of all degrees measured):
``a`` the scale (the machine runs the layouts this much slower or faster than priced), ``b``
a cost each micro-batch pays that the price lacks (launches, the data's trip to the device,
hooks). With fewer than two distinct prices seen, only ``a`` (the ratio of the sums). An
affine map with a > 0 keeps what the planners and their lower bound rely on (`cost.profiled`):
a larger micro-batch never costs less, and a mixed micro-batch costs at least what any of its
sizes' copies cost alone. Recomputation's extra time scales by ``a`` only (it adds work, not
another micro-batch). Memory is not corrected. A `PlanContext` keeps the prices it has seen:
plan with a new one after observing.

A second correction follows the machine's speed as it changes (``track`` > 0: the loader
turns it on for a CPU-calibrated analytic model, whose wall seconds per processor second move
with a shared machine's load): per step, the ratio of the step's measured micro-batch seconds
to their prices under the affine fits (`observe_step`), and the scale ``s``, the median of the
last ``track`` steps' ratios, multiplies every price (``s a t + s b``). A median, not a mean:
one step run while another job burst on the machine moves it less.

`observe` and `observe_step` are deterministic arithmetic on what they are given; the caller
decides which measurements are fed (the first steps of training, or synthetic ones in a test).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Sequence

import numpy as np

from dcparallel.cost.base import MicroBatchTerms
from dcparallel.cost.batch import Batches, TermsArray
from dcparallel.spec import Recompute, Size

#: micro-batches per SP degree the fit keeps (the most recent)
WINDOW = 256
#: the scale is kept within this factor of 1 (a measurement off by more is not a machine's speed)
MAX_SCALE = 20.0


class RefinedCost:
    """``inner`` (any cost model) with per-degree corrections fitted from measured micro-batches;
    ``track``: steps whose median ratio of measured to priced seconds scales every price
    (`observe_step`; 0: no scale)."""

    def __init__(self, inner, track: int = 0):
        self.inner = inner
        self.track = int(track)
        self._ratios: deque[float] = deque(maxlen=max(1, self.track))
        self.scale = 1.0  # the median of `_ratios`: what `observe_step` has seen of the machine's speed
        self.model, self.cluster = inner.model, inner.cluster
        self.sp_sizes = getattr(inner, "sp_sizes", None)
        # sp (None: every degree) -> (priced, measured) seconds, and its fit (a, b)
        self._seen: dict[int | None, deque[tuple[float, float]]] = {}
        self._fit: dict[int | None, tuple[float, float]] = {}

    def __getattr__(self, name: str):  # what the wrapper does not change (best_split, longest_sample, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ fitting

    def observe(self, sizes: Sequence[Size], sp: int, recompute: Recompute, seconds: float) -> None:
        """One micro-batch of ``sizes`` run at degree ``sp`` with ``recompute`` took ``seconds``."""
        if not seconds > 0:
            raise ValueError(f"a measured micro-batch time must be > 0 seconds; got {seconds}")
        priced = self.inner.terms(sizes, sp).time(recompute)
        for key in (sp, None):
            seen = self._seen.setdefault(key, deque(maxlen=WINDOW))
            seen.append((priced, float(seconds)))
            self._fit[key] = _fit(seen)

    def observe_step(self, rows: Sequence[tuple[Sequence[Size], int, Recompute, float]]) -> None:
        """One step's micro-batches (sizes, sp, recompute, seconds) took these seconds: its ratio of
        measured to priced (under the affine fits, without `scale`) joins the last ``track``
        steps', whose median becomes `scale`. A step without micro-batches changes nothing."""
        if not self.track:
            raise ValueError("observe_step needs a RefinedCost made with track > 0")
        priced = measured = 0.0
        for sizes, sp, recompute, seconds in rows:
            a, b = self._fit.get(sp) or self._fit.get(None, (1.0, 0.0))
            priced += a * self.inner.terms(sizes, sp).time(recompute) + b
            measured += float(seconds)
        if priced > 0 and measured > 0:
            self._ratios.append(float(np.clip(measured / priced, 1 / MAX_SCALE, MAX_SCALE)))
            self.scale = statistics.median(self._ratios)

    @property
    def fitted(self) -> list[int]:
        """The SP degrees measured so far, each with a fit of its own."""
        return sorted(k for k in self._fit if k is not None)

    def correction(self, sp: int) -> tuple[float, float]:
        """(a, b) at degree ``sp``, times `scale`; at a degree not observed yet, the fit of every
        degree observed (the same machine); (1, 0) times `scale` before any observation."""
        a, b = self._fit.get(sp) or self._fit.get(None, (1.0, 0.0))
        return a * self.scale, b * self.scale

    # ------------------------------------------------------------------ the cost-model interface

    def terms(self, sizes: Sequence[Size], sp: int) -> MicroBatchTerms:
        return self._scaled(self.inner.terms(sizes, sp), sp)

    def terms_copies(self, size: Size, count: int, sp: int) -> MicroBatchTerms:
        return self._scaled(self.inner.terms_copies(size, count, sp), sp)

    def terms_grid(self, batches: Batches, sps: Sequence[int]) -> TermsArray:
        grid = self.inner.terms_grid(batches, sps)
        a = np.array([self.correction(sp)[0] for sp in sps])
        b = np.array([self.correction(sp)[1] for sp in sps])
        return dataclasses.replace(
            grid,
            time_none=grid.time_none * a + b,
            dt_attn=grid.dt_attn * a,
            dt_mlp=grid.dt_mlp * a,
            dt_full=grid.dt_full * a,
        )

    def grad_sync_time(self) -> float:
        return self.inner.grad_sync_time()

    def model_state_bytes(self) -> float:
        return self.inner.model_state_bytes()

    def add_state_bytes(self, extra: float) -> None:
        self.inner.add_state_bytes(extra)

    def _scaled(self, t: MicroBatchTerms, sp: int) -> MicroBatchTerms:
        a, b = self.correction(sp)
        if (a, b) == (1.0, 0.0):
            return t
        return dataclasses.replace(
            t, time_none=a * t.time_none + b, dt_attn=a * t.dt_attn, dt_mlp=a * t.dt_mlp, dt_full=a * t.dt_full
        )


def _fit(seen: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) minimizing sum(((a p + b) / m - 1)^2) over (p, m) = (priced, measured), a > 0,
    b >= 0; with one distinct price, b = 0 and a = sum(m) / sum(p)."""
    p = np.array([x[0] for x in seen])
    m = np.array([x[1] for x in seen])
    scale = float(np.clip(m.sum() / p.sum(), 1 / MAX_SCALE, MAX_SCALE))
    if np.ptp(p) <= 1e-9 * p.max():
        return scale, 0.0
    (a, b), *_ = np.linalg.lstsq(np.stack([p / m, 1 / m], axis=1), np.ones_like(m), rcond=None)
    if b < 0 or a <= 0:  # the best fit without a fixed cost: a alone, least squares of the relative error
        a, b = float((p / m).sum() / ((p / m) ** 2).sum()), 0.0
    return float(np.clip(a, 1 / MAX_SCALE, MAX_SCALE)), float(b)
