"""`dcp`'s class-level search over makespan targets: candidate layouts per (bucket, count),
and per target T the layout of least GPU-seconds of every bucket whose micro-batches finish
within T, if the groups those need fit the world.

The candidate rows of a phase's buckets are one array, a segment per bucket, least
GPU-seconds first. A target's choice is, per bucket, its first row with time <= T (and SP at
least the search's smallest degree): all targets of a search are evaluated at once, by
counting per bucket the leading rows whose running minimum time exceeds each target.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from dcparallel.plan.dcp_setup import SEARCH_COARSE, memo
from dcparallel.plan.types import ROUND_EPS

if TYPE_CHECKING:
    from dcparallel.plan.dcp_scale import ScalePlanner

#: a phase's candidate rows: columns of `table`'s "a"
ROW_FIELDS = ("gpu_s", "k", "m", "t_full", "full", "t_rem", "rem", "total")


def rows(p: ScalePlanner, j: int, c: int) -> np.ndarray:
    """Candidate layouts of `c` samples of bucket j, least GPU-seconds first, one row each
    (`ROW_FIELDS`: GPU-seconds, degree, micro-batch size, a full micro-batch's time, how many,
    the time of the rest, its samples, busy seconds). Micro-batch sizes per degree: powers of
    two and even splits of c (c / 1, c / 2, c / 4, ... rounded up), capped at the most that
    fit. Cached per planner."""
    return memo(p._rows, (j, c), lambda: _rows(p, j, c))


def _rows(p: ScalePlanner, j: int, c: int) -> np.ndarray:
    x = np.union1d(p._pow2, -(-c // (1 << np.arange(c.bit_length()))))  # sorted; includes c
    cap = np.minimum(p._tops[:, j], c)
    kp = np.flatnonzero(cap > 0)
    ms = np.minimum(cap[kp, None], x[None, :])  # rows sorted, so repeats are adjacent
    keep = np.ones(ms.shape, dtype=bool)
    keep[:, 1:] = ms[:, 1:] != ms[:, :-1]
    kp = np.broadcast_to(kp[:, None], ms.shape)[keep]
    ms = ms[keep]
    full, rem = np.divmod(c, ms)
    t, tr = p._ttab3[kp, j, ms], p._ttab3[kp, j, rem]
    total = full * t + tr
    k = p._spa[kp]
    out = np.column_stack((total * k, k, ms, t, full, tr, rem, total)).astype(float)
    return out[np.lexsort((ms, k, out[:, 0]))]


def table(p: ScalePlanner, present: list[int], counts: list[int], scale: dict[int, tuple[float, float]]) -> dict:
    """The candidate rows of a phase's buckets as arrays, one segment per bucket, their
    times scaled by the bucket's mean weight in this step."""
    arrs = [rows(p, j, c) for j, c in zip(present, counts)]
    lens = [len(x) for x in arrs]
    a = np.concatenate(arrs)
    f = np.repeat(np.array([scale[j][0] for j in present]), lens)
    fmax = np.repeat(np.array([scale[j][1] for j in present]), lens)
    for col in (0, 7):  # work: the bucket's mean weight
        a[:, col] = a[:, col] * f
    for col in (3, 5):  # a micro-batch's time: its longest samples could land in any one
        a[:, col] = a[:, col] * fmax
    pos = np.zeros(max(p.sp) + 1, dtype=np.int64)
    pos[p.sp] = np.arange(len(p.sp))
    return {"a": a, "k": a[:, 1], "t": a[:, 3], "full": a[:, 4], "tr": a[:, 5], "rem": a[:, 6],
            "tot": a[:, 7], "items": a[:, 4] + (a[:, 6] > 0), "kpos": pos[a[:, 1].astype(np.int64)],
            "starts": np.cumsum([0] + lens[:-1]), "n": len(a),
            "seg": np.repeat(np.arange(len(lens)), lens), "lens": np.asarray(lens),
            "spf": np.asarray(p.sp, dtype=float)}


def fits(p: ScalePlanner, tab: dict, ts: np.ndarray, kmin: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every target of the sorted array `ts`: whether its rows fit the world, the rows
    ([target, bucket] indices into the table) and the groups they need per SP degree
    ([target, degree index]). A bucket's row for T is its first row with SP >= kmin and
    time <= T; the groups a degree needs are its work over T, at least one per micro-batch
    longer than T / 2, at most one per micro-batch (0 for a degree without micro-batches)."""
    n, nt, nk = tab["n"], len(ts), len(p.sp)
    starts, seg = tab["starts"], tab["seg"]
    nb = len(starts)
    v = np.where(tab["k"] >= kmin, tab["t"], np.nan)  # nan ranks above every target
    shift = (nb - seg) * (nt + 1)  # later buckets lower, so one running minimum stays per bucket
    r = np.minimum.accumulate(np.searchsorted(ts, v) + shift) - shift  # its min time > ts[j] iff j < r
    hist = np.bincount(seg * (nt + 1) + r, minlength=nb * (nt + 1)).reshape(nb, nt + 1)
    above = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1][:, 1:]  # [bucket, j]: rows with min time > ts[j]
    ok = (above < tab["lens"][:, None]).all(axis=0)
    first = np.minimum(starts[:, None] + above, n - 1).T
    T = ts[:, None]
    flat = (np.arange(nt)[:, None] * nk + tab["kpos"][first]).ravel()
    size = nt * nk
    work = np.bincount(flat, weights=tab["tot"][first].ravel(), minlength=size).reshape(nt, nk)
    big = np.where(tab["t"][first] > T / 2, tab["full"][first], 0.0) + \
        ((tab["rem"][first] > 0) & (tab["tr"][first] > T / 2))
    bigk = np.bincount(flat, weights=big.ravel(), minlength=size).reshape(nt, nk)
    items = np.bincount(flat, weights=tab["items"][first].ravel(), minlength=size).reshape(nt, nk)
    need = np.minimum(items, np.maximum(np.maximum(1.0, bigk), np.ceil(work / T - ROUND_EPS)))
    need = np.where(items > 0, need, 0.0)
    return ok & (need @ tab["spf"] <= p.world), first, need


def rows_at(tab: dict, first: np.ndarray) -> list[tuple]:
    """The table's rows `first` as tuples (`ROW_FIELDS`, counts as ints)."""
    return [(g, int(k), int(m), t, int(full), tr, int(rem), tot)
            for g, k, m, t, full, tr, rem, tot in tab["a"][first].tolist()]


def search(p: ScalePlanner, tab: dict, kmin: int) -> list[tuple[float, list[tuple], dict[int, int]]]:
    """Layouts at the smallest feasible target T and at a few larger ones, each with the
    groups per SP degree it needs (`fits`; degrees without micro-batches left out). Targets are the
    distinct micro-batch times; a coarse pass over `SEARCH_COARSE` of them brackets the
    smallest that fits, a second pass over the bracket finds it and the candidates after it.
    If none fits: least work (T infinite), if that fits."""
    ok = tab["k"] >= kmin
    if not ok.any():
        return []
    floor = float(np.minimum.reduceat(np.where(ok, tab["t"], np.inf), tab["starts"]).max())
    if not math.isfinite(floor):
        return []
    ts = np.unique(tab["t"][ok & (tab["t"] >= floor)])
    coarse = np.unique(np.linspace(0, len(ts) - 1, min(len(ts), SEARCH_COARSE)).astype(np.int64))
    fit = fits(p, tab, ts[coarse], kmin)[0]
    if not fit.any():
        fit, first, need = fits(p, tab, np.array([math.inf]), kmin)
        return [(math.inf, rows_at(tab, first[0]), _needs(p, need[0]))] if fit[0] else []
    c = int(np.argmax(fit))
    lo = int(coarse[c - 1]) + 1 if c > 0 else 0
    window = np.arange(lo, min(len(ts), int(coarse[c]) + 9))
    fit, first, need = fits(p, tab, ts[window], kmin)
    at = int(np.argmax(fit))
    out, seen = [], set()
    for i in (at, at + 1, at + 2, at + 4, at + 8):
        if i >= len(window) or not fit[i]:
            continue
        ch = rows_at(tab, first[i])
        sig = tuple((r[1], r[2]) for r in ch)
        if sig not in seen:
            seen.add(sig)
            out.append((float(ts[window[i]]), ch, _needs(p, need[i])))
    return out


def _needs(p: ScalePlanner, need: np.ndarray) -> dict[int, int]:
    return {k: int(n) for k, n in zip(p.sp, need.tolist()) if n > 0}
