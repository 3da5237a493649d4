"""Micro-batch terms of many micro-batches at once, as numpy arrays.

The planners price thousands of candidate micro-batches at every SP degree per step; one
Python call per (micro-batch, degree) is most of a heavy-tail step's planning. `TermsArray`
holds the `MicroBatchTerms` of a grid of them (micro-batches x degrees) field by field, and
its `time`, `memory` and `cheapest_recompute` do the scalar methods' arithmetic elementwise,
operation for operation in the same order, so every element equals what the scalar method
returns for that micro-batch, bit for bit: plans priced either way are identical.

The one operation numpy does not do as Python does is a power: Python's ``x ** p`` calls the
C library's ``pow``, while numpy's `power` squares for ``** 2``, takes a square root for
``** 0.5`` and, on CPUs with AVX-512, uses its own vectorised ``pow`` (SVML); these differ from
the C library's in the last bit of some results. `exact_pow` computes ``pow`` as Python does:
with numpy's `float_power`, whose float64 loop calls the C library's ``pow`` on every CPU (no
vectorised variant), where a probe finds it equal to Python's; else element by element.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import repeat
from typing import Sequence

import numpy as np

from dcparallel.cost.vision import vision_stats
from dcparallel.spec import ModelSpec, Size


def _float_power_is_libm() -> bool:
    """Whether numpy's float64 `float_power` agrees with Python's ``**`` (the C library's
    ``pow``) here, on probe values spread over the exponents and magnitudes priced: its loop
    calls ``pow`` for each element (numpy has no vectorised `float_power`); a numpy that
    vectorised it would fail the probe and take the element-by-element path."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.random(200) * 10.0**e for e in range(-9, 7, 3)])
    xs = x.tolist()
    for p in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.5, 0.25, 1 / 3, 1 / 6, 1 / 1.5, 2.4):
        if np.float_power(x, p).tolist() != [v**p for v in xs]:
            return False
    return True


_POW_IS_LIBM = _float_power_is_libm()


def exact_pow(x: np.ndarray, p: float) -> np.ndarray:
    """``x ** p`` elementwise, each element bit for bit Python's float ``x ** p``."""
    if _POW_IS_LIBM:
        return np.float_power(x, float(p))
    return np.fromiter(map(pow, x.ravel().tolist(), repeat(float(p))), float, x.size).reshape(x.shape)


@dataclass(frozen=True, slots=True)
class Batches:
    """Micro-batches as runs of consecutive samples: each sample's tokens
    (`ModelSpec.tokens`) and query-key pairs (`ModelSpec.attention_pairs`, as a float), the
    first `lengths[0]` samples the first micro-batch's, and so on; with a vision tower, each
    sample's `cost.vision.sample_vision` as an (n, 4) int64 array (None: no vision tower)."""

    tokens: np.ndarray
    pairs: np.ndarray
    lengths: np.ndarray
    vision: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    @staticmethod
    def of(model: ModelSpec, batches: Sequence[Sequence[Size]]) -> Batches:
        flat = [s for b in batches for s in b]
        return Batches(
            np.array([model.tokens(s) for s in flat], dtype=np.int64),
            np.array([float(model.attention_pairs(s)) for s in flat], dtype=float),
            np.fromiter(map(len, batches), dtype=np.int64, count=len(batches)),
            vision_stats(model, flat),
        )

    def subset(self, js: np.ndarray) -> Batches:
        """The micro-batches `js` (ascending indices) of these, each with its samples in
        order: every micro-batch's sums and maxima are its own, so they stay the same."""
        if len(js) == len(self.lengths):
            return self
        keep = np.zeros(len(self.lengths), dtype=bool)
        keep[js] = True
        rows = np.repeat(keep, self.lengths)  # per sample: whether its micro-batch is kept
        vision = None if self.vision is None else self.vision[rows]
        return Batches(self.tokens[rows], self.pairs[rows], self.lengths[js], vision)

    def token_sums(self) -> np.ndarray:
        """Each micro-batch's tokens (exact integers)."""
        cum = np.concatenate([[0], np.cumsum(self.tokens, dtype=np.int64)])
        ends = np.cumsum(self.lengths)
        return cum[ends] - cum[ends - self.lengths]

    def vision_sums(self) -> tuple[np.ndarray, ...]:
        """Each micro-batch's vision patches and pairs (sums) and its largest item's (maxima):
        four int64 arrays, exact."""
        assert self.vision is not None and bool((self.lengths > 0).all())
        ends = np.cumsum(self.lengths)
        starts = ends - self.lengths
        cum = np.concatenate([np.zeros((1, 4), np.int64), np.cumsum(self.vision, axis=0, dtype=np.int64)])
        sums = cum[ends] - cum[starts]
        peaks = np.maximum.reduceat(self.vision, starts, axis=0) if len(self) else sums
        return sums[:, 0], sums[:, 1], peaks[:, 2], peaks[:, 3]

    def pair_sums(self) -> np.ndarray:
        """Each micro-batch's pairs, summed as `sequential_sums` does."""
        return sequential_sums(self.pairs, self.lengths)

    def token_runs(self) -> list[list[int]]:
        """Each micro-batch's samples' tokens."""
        return [r.tolist() for r in np.split(self.tokens, np.cumsum(self.lengths)[:-1])] if len(self) else []


@dataclass(frozen=True, slots=True)
class TermsArray:
    """`MicroBatchTerms` of many micro-batches: each field an array of one shape (typically
    micro-batches x SP degrees); `num_layers` is the model's, shared."""

    num_layers: int
    time_none: np.ndarray
    dt_attn: np.ndarray
    dt_mlp: np.ndarray
    dt_full: np.ndarray
    fixed_bytes: np.ndarray
    act_layer: np.ndarray
    save_attn: np.ndarray
    save_mlp: np.ndarray
    save_full: np.ndarray
    transient_none: np.ndarray
    transient_rec: np.ndarray
    keep_all_feasible: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.time_none.shape

    @staticmethod
    def stack(terms: Sequence, shape: tuple[int, ...]) -> TermsArray:
        """The `MicroBatchTerms` `terms` (in C order of `shape`) as arrays of `shape`."""
        L = {t.num_layers for t in terms}
        assert len(L) <= 1, L
        cols = {
            f.name: np.array(
                [getattr(t, f.name) for t in terms], dtype=bool if f.name == "keep_all_feasible" else float
            ).reshape(shape)
            for f in fields(TermsArray)
            if f.name != "num_layers"
        }
        return TermsArray(num_layers=L.pop() if L else 0, **cols)

    def take(self, mask: np.ndarray) -> TermsArray:
        """The elements where `mask` holds, as 1-D arrays."""
        return TermsArray(
            self.num_layers,
            **{f.name: getattr(self, f.name)[mask] for f in fields(TermsArray) if f.name != "num_layers"},
        )

    def time(self, attn, mlp) -> np.ndarray:
        """`MicroBatchTerms.time` of each element with recompute counts (attn, mlp) (arrays
        or ints, broadcast)."""
        L = self.num_layers
        a, m = np.minimum(attn, L), np.minimum(mlp, L)
        f = np.minimum(a, m)
        return self.time_none + f * self.dt_full + (a - f) * self.dt_attn + (m - f) * self.dt_mlp

    def memory(self, attn, mlp) -> np.ndarray:
        """`MicroBatchTerms.memory` of each element with recompute counts (attn, mlp)."""
        L = self.num_layers
        a, m = np.minimum(attn, L), np.minimum(mlp, L)
        f = np.minimum(a, m)
        saved = f * self.save_full + (a - f) * self.save_attn + (m - f) * self.save_mlp
        transient = np.where((a == 0) & (m == 0), self.transient_none, self.transient_rec)
        out = self.fixed_bytes + L * self.act_layer - saved + transient
        return np.where(~self.keep_all_feasible & (f < L), np.inf, out)

    def cheapest_recompute(self, budget: float) -> tuple[np.ndarray, np.ndarray]:
        """`MicroBatchTerms.cheapest_recompute` of each element: the recompute counts (attn,
        mlp) as int arrays, -1 in both where nothing fits."""
        L = self.num_layers
        attn = np.full(self.shape, -1, dtype=np.int64)
        mlp = np.full(self.shape, -1, dtype=np.int64)
        none = self.memory(0, 0) <= budget
        attn[none] = 0
        mlp[none] = 0
        only_full = ~none & ~self.keep_all_feasible
        if only_full.any():
            ok = only_full & (self.memory(L, L) <= budget)
            attn[ok] = L
            mlp[ok] = L
        scan = ~none & self.keep_all_feasible
        if scan.any():
            a, m = self.take(scan).scan_recompute(budget)
            attn[scan] = a
            mlp[scan] = m
        return attn, mlp

    def scan_recompute(self, budget: float) -> tuple[np.ndarray, np.ndarray]:
        """`cheapest_recompute` past its first two returns, on 1-D arrays: the scalar loop's
        candidates (kind, f) for every element at once, each element's own start
        (`_first_fit`) and end (the break) masked, then the best taken in the loop's order
        with its tolerance (a later candidate wins only if faster by more than 1e-15)."""
        L, n = self.num_layers, self.shape[0]
        need = (self.fixed_bytes + L * self.act_layer + self.transient_rec - budget)[:, None]
        F = np.arange(L + 1)[None, :]
        sf, tf = self.save_full[:, None], self.dt_full[:, None]
        ts, xs, oks = [], [], []
        with np.errstate(all="ignore"):
            for save, dt in ((self.save_attn, self.dt_attn), (self.save_mlp, self.dt_mlp)):
                first = _first_fit_many(need[:, 0], sf[:, 0], save, L)[:, None]
                save, dt = save[:, None], dt[:, None]
                rest = need - F * sf
                ends = rest <= 0
                x = np.where(ends, np.where(F > 0, 0.0, 1.0), np.maximum(1, np.ceil(rest / save - 1e-9)))
                skip = np.where(ends, (F == 0) & (save <= 0), save <= 0) | (F + x > L)
                go = (F >= first) & ~skip
                stop = go & ends  # the loop breaks after the first of these
                last = np.where(stop.any(axis=1), stop.argmax(axis=1), L)[:, None]
                oks.append(go & (F <= last))
                ts.append(F * tf + x * dt)
                xs.append(x)
        ok, t, xx = np.hstack(oks), np.hstack(ts), np.hstack(xs)
        best_t = np.full(n, np.inf)
        best = np.full(n, -1, dtype=np.int64)  # column: kind * (L + 1) + f
        for c in np.flatnonzero(ok.any(axis=0)).tolist():
            better = ok[:, c] & (t[:, c] < best_t - 1e-15)
            best_t = np.where(better, t[:, c], best_t)
            best = np.where(better, c, best)
        found = best >= 0
        col = np.maximum(best, 0)
        best_kind, best_f = col // (L + 1), col % (L + 1)
        best_x = np.where(found, xx[np.arange(n), col], 0).astype(np.int64)  # rows not found: unused
        attn = np.where(best_kind == 0, best_f + best_x, best_f)
        mlp = np.where(best_kind == 0, best_f, best_f + best_x)
        # rounding at the boundary: one more layer of that kind, else full recomputation
        over = found & (self.memory(attn, mlp) > budget)
        a2, m2 = attn + (over & (best_kind == 0)), mlp + (over & (best_kind == 1))
        bad = over & ((np.maximum(a2, m2) > L) | (self.memory(a2, m2) > budget))
        attn, mlp = np.where(over, a2, attn), np.where(over, m2, mlp)
        full_ok = self.memory(L, L) <= budget
        attn = np.where(bad, np.where(full_ok, L, -1), attn)
        mlp = np.where(bad, np.where(full_ok, L, -1), mlp)
        return np.where(found, attn, -1), np.where(found, mlp, -1)


def _first_fit_many(need: np.ndarray, sf: np.ndarray, save: np.ndarray, L: int) -> np.ndarray:
    """`base._first_fit` elementwise (int array)."""
    with np.errstate(all="ignore"):
        ok = (save > 0) & (sf > save * (1 + 1e-6))
        first = (need / save - L - 1e-9) / (sf / save - 1)
        low = np.minimum(np.minimum(first, need / sf), L)
        out = np.maximum(0, np.trunc(np.where(ok, low, 0.0)) - 2)
    return np.where(ok, out, 0).astype(np.int64)


def sequential_sums(values: Sequence[float], lengths: np.ndarray) -> np.ndarray:
    """Per run of `lengths` consecutive `values`, their sum added left to right from 0.0, as a
    Python loop ``s = 0.0; s += v`` adds them (a numpy reduction adds pairwise, in another order)."""
    n = len(lengths)
    out = np.zeros(n)
    if n == 0:
        return out
    vals = np.asarray(values, dtype=float)
    if len(vals) and float(np.abs(vals).max()) * len(vals) < 2**53 and np.array_equal(vals, np.trunc(vals)):
        # integers whose every partial sum is below 2**53: exact in any order (attention pairs)
        cum = np.concatenate([[0.0], np.cumsum(vals)])
        ends = np.cumsum(lengths)
        return cum[ends] - cum[ends - lengths]
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    for j in range(int(lengths.max(initial=0))):
        rows = lengths > j
        out[rows] += vals[starts[rows] + j]
    return out
