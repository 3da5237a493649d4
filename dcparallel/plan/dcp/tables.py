"""`dcp`'s per-run tables: planning classes, their largest samples, per-sample weights;
bounded caches.

The classes are the context's buckets, or finer text length ranges.

Short names: p (a `LayoutTable`, in the free functions), j (a class: an index into the
planning classes `pclasses`), b (a planning class's key: the context's bucket, or with finer
classes (bucket, length range)), k (an SP degree), kp (a degree's index into `sp`), m / ms (a
micro-batch size), c / cs (a sample count), pr (a row's (class, count) pair), t / tr (a full
micro-batch's / the rest's time), rep (a class's largest sample).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, NamedTuple

import numpy as np

from dcparallel.cost.vision import class_rep
from dcparallel.plan.context import MAX_COPIES, PlanContext, RecomputeMode, mbs_candidates
from dcparallel.plan.dcp.classes import GroupClass, class_span, deal_classes
from dcparallel.plan.dcp.config import DEFAULT, DcpConfig
from dcparallel.plan.types import REL_TOL, TIME_EPS, Fit
from dcparallel.spec import VisionSize


class Row(NamedTuple):
    """A candidate layout of a class's samples in a step (`search.rows`), one row of `search.StepTable.a`;
    as a `Row` of arrays (`search.StepTable.cols`), the columns of many rows."""

    gpu_s: float  #: GPU-seconds
    k: int  #: SP degree
    m: int  #: micro-batch size
    t_full: float  #: a full micro-batch's time
    full: int  #: full micro-batches
    t_rem: float  #: the rest's time (0 without a rest)
    rem: int  #: the rest's samples
    total: float  #: busy seconds


def least_gpu_seconds_within(gpu_s: np.ndarray, finish: np.ndarray, target: float) -> np.ndarray:
    """The layout rule `dcp` plans by: of each row's layouts (the last axis: degrees, or a
    class's candidate rows), the position of the one of least GPU-seconds among those that
    finish within `target`; the first on ties. Every row must have one that finishes within it.
    The per-sample packing applies it as it stands (`sample.SamplePacker.pack`); the class
    level's search applies it to every target at once: a class's rows are sorted by
    GPU-seconds, so its choice is its first row within the target (`search.fits`)."""
    return np.where(finish <= target, gpu_s, np.inf).argmin(axis=-1)


def memo(cache: dict, key, make: Callable[[], Any], limit: int):
    """`cache[key]`, made by `make()` on a miss; a cache of `limit` entries is emptied first
    (bounded memory, and a planner's results do not depend on what it has cached)."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) >= limit:
            cache.clear()
        hit = cache[key] = make()
    return hit


def planning_classes(ctx: PlanContext, sub_bins: int) -> tuple[dict, list, np.ndarray]:
    """(largest sample size per class, the classes in order, each sample's class index; -1 for
    skipped samples). `sub_bins` == 1: the context's buckets; more: each bucket cut into length
    ranges 2 ** (1 / sub_bins) apart (text)."""
    if sub_bins == 1:  # each usable sample's bucket, by its position among all of them
        rep = dict(ctx.rep)
        classes = sorted(rep)
        pos = {b: j for j, b in enumerate(classes)}
        keys, at = ctx.bucket_positions()
        ids = np.asarray(ctx.usable_ids, dtype=np.int64)
        bidx = np.full(len(ctx.sizes), -1, dtype=np.int64)
        bidx[ids] = np.array([pos.get(b, -1) for b in keys], dtype=np.int64)[at[ids]]
        return rep, classes, bidx
    if not any(issubclass(c, VisionSize) for c in set(map(type, ctx.sizes))):
        return _length_classes(ctx, sub_bins)
    key = {i: (ctx.bucket_of[i], _length_range(ctx.tokens[i], sub_bins)) for i in ctx.usable_ids}
    members: dict = {}
    for i, c in key.items():
        members.setdefault(c, []).append(i)
    rep = {c: class_rep([ctx.sizes[i] for i in ids], [ctx.tokens[i] for i in ids]) for c, ids in members.items()}
    classes = sorted(rep)
    pos = {b: j for j, b in enumerate(classes)}
    bidx = np.full(len(ctx.sizes), -1, dtype=np.int64)
    for i, c in key.items():
        bidx[i] = pos[c]
    return rep, classes, bidx


def _length_range(tokens: int, sub_bins: int) -> int:
    """A text sample's length range within its class: ranges 2 ** (1 / sub_bins) apart."""
    return int(math.log2(max(1, tokens)) * sub_bins)


def _length_ranges(lengths: np.ndarray, sub_bins: int) -> np.ndarray:
    """`_length_range` of each of `lengths`: numpy's log2 where its value is more than 1e-9
    from a range's boundary (numpy's and `math`'s log2 differ by a few units of 2**-53, so
    they floor alike there), `_length_range` itself at the others."""
    v = np.log2(np.maximum(lengths, 1).astype(float)) * sub_bins
    out = np.floor(v).astype(np.int64)
    near = np.flatnonzero(np.abs(v - np.round(v)) <= 1e-9)
    out[near] = [_length_range(x, sub_bins) for x in lengths[near].tolist()]
    return out


def _length_classes(ctx: PlanContext, sub_bins: int) -> tuple[dict, list, np.ndarray]:
    """`planning_classes` of finer length ranges where no sample is a `VisionSize` (so a
    class's `class_rep` is its member of most tokens, the first of equals), in array passes:
    each distinct length's range by `_length_ranges`; classes (class, range) in key order,
    as `sorted` orders them, since classes are numbered in their order."""
    ids = np.asarray(ctx.usable_ids, dtype=np.int64)
    pclasses, bucket_at = ctx.bucket_positions()
    bpos = bucket_at[ids]
    tok = ctx.token_array()[ids]
    lengths, at = np.unique(tok, return_inverse=True)
    ranges = _length_ranges(lengths, sub_bins)[at.reshape(-1)]
    width = int(ranges.max(initial=0)) + 1
    codes, cls = np.unique(bpos * width + ranges, return_inverse=True)
    cls = cls.reshape(-1)
    classes = [(pclasses[c // width], c % width) for c in codes.tolist()]
    order = np.lexsort((ids, -tok, cls))  # per class: most tokens first, then by id
    first = order[np.flatnonzero(np.diff(cls[order], prepend=-1))]
    rep = {c: ctx.sizes[i] for c, i in zip(classes, ids[first].tolist())}
    bidx = np.full(len(ctx.sizes), -1, dtype=np.int64)
    bidx[ids] = cls
    return rep, classes, bidx


def _cheapest(p: LayoutTable, j: int) -> tuple[int, int]:
    """(SP degree, micro-batch size) of least GPU-seconds per sample for finer class j: finer
    classes are not the context's buckets, so `PlanContext.preferred` cannot answer; their
    layouts come from this table (on a near tie within REL_TOL, the narrower degree)."""
    best = None
    for k in p.sp:
        top = p.most[(j, k)]  # copies: not capped at the class's samples
        for m in mbs_candidates(top, MAX_COPIES) if top else ():
            g = p.layout(j, m, k).time * k / m
            if best is None or g < best[0] * (1 - REL_TOL):
                best = (g, k, m)
    return best[1], best[2]


def sample_weights(p: LayoutTable) -> np.ndarray:
    """Per sample, its micro-batch time relative to its class's largest sample: a class's
    times are planned for copies of its largest sample and scaled by the mean weight of the
    samples a step holds (a text bucket spans 1.25x in length, more in attention work).
    Linear in tokens between the class's smallest and largest sample, both timed by the
    cost model as a full micro-batch of the class's preferred layout (convex times make
    this slightly pessimistic, never optimistic)."""
    ctx = p.ctx
    tok = p.tok.astype(float)
    w = np.ones(len(ctx.sizes))
    ids = np.asarray(ctx.usable_ids, dtype=np.int64)
    cj = p.bidx[ids]
    order = np.lexsort((ids, tok[ids], cj))  # per class: fewest tokens first, then by id
    first = order[np.flatnonzero(np.diff(cj[order], prepend=-1))]
    small = dict(zip(cj[first].tolist(), ids[first].tolist()))  # per class, its first smallest sample
    lo = np.zeros(len(p.pclasses))
    t_lo = np.ones(len(p.pclasses))
    hi = np.ones(len(p.pclasses))
    for j, b in enumerate(p.pclasses):
        big_s, small_s = p.rep[b], ctx.sizes[small[j]]
        if p.sub_bins > 1:
            k, m = _cheapest(p, j)
        else:
            pref = ctx.preferred(b, p.mode).layout
            k, m = pref.sp, pref.mbs
        tb = ctx.cost.terms_copies(big_s, m, k).time_none
        ts = ctx.cost.terms_copies(small_s, m, k).time_none
        lo[j], hi[j] = ctx.model.tokens(small_s), ctx.model.tokens(big_s)
        t_lo[j] = min(1.0, ts / tb) if tb > 0 else 1.0
    span = np.maximum(hi[cj] - lo[cj], TIME_EPS)
    u = np.clip((tok[ids] - lo[cj]) / span, 0.0, 1.0)
    w[ids] = np.where(hi[cj] > lo[cj], t_lo[cj] + (1.0 - t_lo[cj]) * u, 1.0)
    return w


class LayoutTable:
    """Per run: the planning classes of `ctx` (`sub_bins` > 1: finer text length ranges) on the
    SP degrees mixed (`PlanContext.mix_sizes`; `chain_only`: the chain), each class's layouts
    and micro-batch times by degree and size, the samples' weights and planning order; and the
    bounded caches of what the class level builds from them."""

    def __init__(
        self,
        ctx: PlanContext,
        *,
        mode: RecomputeMode = "pac",
        sub_bins: int = 1,
        chain_only: bool = False,
        config: DcpConfig = DEFAULT,
    ):
        self.ctx, self.mode = ctx, mode
        #: the tunables (`config.DcpConfig`)
        self.config = config
        self.world = ctx.cluster.world_size
        self.tok = ctx.token_array()
        #: planning classes: the context's buckets, or (text, `sub_bins` > 1) each bucket cut
        #: into `sub_bins` geometric length ranges, each sized by its own largest sample
        self.sub_bins = sub_bins if ctx.model.kind == "text" else 1
        self.rep, self.pclasses, self.bidx = planning_classes(ctx, self.sub_bins)
        #: the SP degrees mixed (`PlanContext.mix_sizes`, or with `chain_only` its `sp_sizes`);
        #: where they are not one chain, group counts must pass `Topology.fits` (else: at most
        #: the world's ranks)
        self.sp = list(ctx.sp_sizes if chain_only else ctx.mix_sizes)
        self.packs = None if set(self.sp) <= set(ctx.topology.chain) else ctx.topology.fits
        #: per (class, degree): the most copies of its largest sample that fit (`PlanContext.most_copies`)
        self.most = {
            (j, k): ctx.most_copies(self.rep[b], k, mode) for j, b in enumerate(self.pclasses) for k in self.sp
        }
        #: ... and the most a micro-batch of the class may hold: at most its samples in the
        #: workload (a step's class holds no more; an RL step's planner, built for that step
        #: alone, prices only those counts)
        held = np.bincount(self.bidx[self.bidx >= 0], minlength=len(self.pclasses)).tolist()
        self.top = {(j, k): min(m, held[j]) for (j, k), m in self.most.items()}
        self._rows: dict[tuple[int, int], np.ndarray] = {}
        #: `allocate`'s caches: spans by (classes' id, groups), ids by the classes
        self._spans: dict[tuple, float] = {}
        self._deals: dict[tuple, list] = {}
        self._sigs: dict[tuple, int] = {}
        self._tiles: dict[tuple, list] = {}
        self._least_gpu: dict[tuple, list] = {}  # `least_gpu`'s tables per set of degrees
        #: per (class, degree): the time of a micro-batch of m copies of its largest sample, m = 0..top
        self.ttab = {key: row for k in self.sp for key, row in self._copies_times(k).items()}
        #: the same per degree as one array, [class, m] (inf where m copies do not fit)
        width = 1 + max(self.top.values(), default=0)
        self.ttab_arr = {
            k: np.array(
                [self.ttab[(j, k)] + [np.inf] * (width - len(self.ttab[(j, k)])) for j in range(len(self.pclasses))]
            ).reshape(len(self.pclasses), width)
            for k in self.sp
        }
        self._ttab3 = np.stack([self.ttab_arr[k] for k in self.sp])  # [degree index, class, m]
        self._tops = np.array([[self.top[(j, k)] for j in range(len(self.pclasses))] for k in self.sp])
        self._spa = np.asarray(self.sp)
        self._pow2 = np.array(mbs_candidates(MAX_COPIES, MAX_COPIES))
        self.weight = sample_weights(self)
        #: every sample in planning order (by class, then longest first, then id) and each
        #: sample's position in it: a step's samples are sorted by sorting their positions
        self._order = np.lexsort((np.arange(len(self.tok)), -self.tok, self.bidx))
        self._rank = np.empty(len(self.tok), dtype=np.int32 if len(self.tok) < 2**31 else np.int64)
        self._rank[self._order] = np.arange(len(self.tok))

    # -- layouts ---------------------------------------------------------------------------
    def layout(self, j: int, m: int, k: int) -> Fit:
        """The layout and time of a micro-batch of m copies of class j's largest sample at degree k."""
        out = self.ctx.copies_layout(self.rep[self.pclasses[j]], m, k, self.mode)
        assert out is not None, "the class's largest micro-batch fits, so smaller ones do"
        return out

    def _copies_times(self, k: int) -> dict[tuple[int, int], list[float]]:
        """Per class j: (j, k) -> [0, then `layout(j, m, k).time` for m = 1..top], priced at once."""
        n = len(self.pclasses)
        got = self.ctx.copies_times(
            [self.rep[b] for b in self.pclasses], [self.top[(j, k)] for j in range(n)], k, self.mode
        )
        assert all(np.isfinite(t).all() for t in got), "the class's largest micro-batch fits, so smaller ones do"
        return {(j, k): [0.0, *t.tolist()] for j, t in enumerate(got)}

    def deal(self, items: list[tuple[int, float, int]], n: int) -> list[GroupClass]:
        """`deal_classes`, cached (the best few candidates of a step often share a degree's
        micro-batch classes); the group classes are read, never changed."""
        return memo(self._deals, (tuple(items), n), lambda: deal_classes(items, n), self.config.row_cache_limit)

    def placed(self, count: dict[int, int]) -> bool:
        """Whether groups of these degrees (degree -> how many) can be placed on the world."""
        if self.packs is None:
            return sum(k * n for k, n in count.items()) <= self.world
        return self.packs(count)

    def room(self, count: dict[int, int], k: int, step: int) -> int:
        """The largest of step, step // 2, ... more groups of degree k that can be placed along
        with `count` (0: none). On a chain that is `step` (callers keep it within the free ranks)."""
        if self.packs is not None:
            while step and not self.packs({**count, k: count[k] + step}):
                step //= 2
        return step

    def sort(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step's ids by planning class, then longest first, then id, and their classes."""
        r = self._rank[ids]
        if 8 * len(r) >= len(self._rank):  # positions are distinct: a mask sorts them in O(samples)
            mask = np.zeros(len(self._rank), dtype=bool)
            mask[r] = True
            r = np.flatnonzero(mask)
        else:
            r.sort()
        out = self._order[r]
        b = self.bidx[out]
        assert not len(b) or b[0] >= 0, "a step holds a skipped sample"  # skipped samples sort first
        return out, b

    def rows_many(self, pairs: list[tuple[int, int]]) -> list[np.ndarray]:
        """`search.rows` of every (class, count) pair, cached; those not cached are built
        together."""
        out = [self._rows.get(x) for x in pairs]
        todo = sorted({x for x, r in zip(pairs, out) if r is None})
        if todo:
            if len(self._rows) + len(todo) > self.config.row_cache_limit:
                self._rows.clear()
            for x, r in zip(todo, self._build_rows(todo)):
                self._rows[x] = r
            out = [self._rows[x] for x in pairs]
        return out

    def _build_rows(self, pairs: list[tuple[int, int]]) -> list[np.ndarray]:
        """`rows_many` of pairs not cached, in a few array operations."""
        js = np.array([j for j, _ in pairs])
        cs = np.array([c for _, c in pairs])
        # micro-batch sizes per pair: the powers of two, and c / 2^i rounded up
        bits = int(cs.max()).bit_length()
        splits = -(-cs[:, None] // (1 << np.arange(bits))[None, :])
        pow2 = np.broadcast_to(self._pow2, (len(pairs), len(self._pow2)))
        x = np.sort(np.concatenate([pow2, splits], axis=1), axis=1)
        # per pair and degree that fits: sizes capped at the most that fit, repeats dropped
        cap = np.minimum(self._tops[:, js].T, cs[:, None])  # [pair, degree index]
        pr, kp = np.nonzero(cap > 0)
        ms = np.minimum(cap[pr, kp][:, None], x[pr])  # sorted along each row, so repeats are adjacent
        keep = np.ones(ms.shape, dtype=bool)
        keep[:, 1:] = ms[:, 1:] != ms[:, :-1]
        pr, kp = np.broadcast_to(pr[:, None], ms.shape)[keep], np.broadcast_to(kp[:, None], ms.shape)[keep]
        ms, c, j = ms[keep], cs[pr], js[pr]
        full, rem = np.divmod(c, ms)
        t, tr = self._ttab3[kp, j, ms], self._ttab3[kp, j, rem]
        total = full * t + tr
        k = self._spa[kp]
        row = Row(gpu_s=total * k, k=k, m=ms, t_full=t, full=full, t_rem=tr, rem=rem, total=total)
        a = np.column_stack(row).astype(float)  # a line per row, `Row`'s fields in order
        # the rows are in (pair, degree, size) order (the degrees ascend: a chain), so a stable
        # sort by (pair, GPU-seconds) breaks ties by degree, then size
        o = np.lexsort((row.gpu_s, pr))
        a = a[o]
        ends = pr.searchsorted(np.arange(len(pairs) + 1)).tolist()  # pr ascends (and is pr[o])
        assert all(i < j for i, j in zip(ends, ends[1:])), "every class fits at its widest degree"
        return [a[i:j] for i, j in zip(ends, ends[1:])]

    def _least_gpu_of(self, kinds: tuple[int, ...]) -> list[list[float]]:
        """[class][m]: the least of k t(b, k, m) / m over the degrees `kinds` (inf where m copies
        fit none of them)."""
        per = np.min([k * self.ttab_arr[k] for k in kinds], axis=0)
        return (per / np.maximum(np.arange(per.shape[1]), 1)).tolist()

    def least_gpu(self, kinds: tuple[int, ...]) -> list[list[float]]:
        """[class][m]: the least of k t(b, k, m) / m over the degrees `kinds`, cached."""
        return memo(self._least_gpu, kinds, partial(self._least_gpu_of, kinds), self.config.least_gpu_cache_limit)

    def tile_starts(self, sizes: list[int]) -> tuple[int, ...]:
        """Each group's first rank, as `Topology.tile` places groups of these sizes (validates); cached."""
        return memo(self._tiles, tuple(sizes), partial(_starts, self.ctx.topology, sizes), self.config.tile_cache_limit)

    def span_id(self, items) -> int:
        """The id of a degree's micro-batch classes' sorted (time, count) pairs (`group_span`'s key)."""
        sig = tuple(sorted((t, q) for _, t, q in items))
        hit = self._sigs.get(sig)
        if hit is None:
            if len(self._sigs) >= self.config.row_cache_limit:
                self._sigs.clear()
                self._spans.clear()  # its keys hold the ids
            hit = self._sigs[sig] = len(self._sigs)
        return hit

    def group_span(self, items, n: int, sig: int) -> float:
        """`classes.class_span` of a degree's micro-batch classes over n groups, cached by `sig`
        (`span_id`)."""
        return memo(self._spans, (sig, n), lambda: class_span(items, n), self.config.row_cache_limit)


def _starts(topology, sizes: list[int]) -> tuple[int, ...]:
    return tuple(b[0] for b in topology.tile(sizes)[: len(sizes)])
