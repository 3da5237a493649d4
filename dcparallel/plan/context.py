"""What every policy needs to know about a workload on a cluster, computed once.

`PlanContext` holds the dataset's sample sizes, their buckets, the memory budget and the
cost model, and answers layout questions with caching: which recompute setting lets a
micro-batch fit, the largest micro-batch that fits, the best layout of a bucket at each
SP degree. Pure python, no process group.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Literal, NamedTuple, Sequence

import numpy as np

from dcparallel.cost.base import CostModel, MicroBatchTerms, cache_put
from dcparallel.cost.batch import Batches, TermsArray
from dcparallel.cost.vision import class_rep, vision_stats
from dcparallel.plan.fit_messages import sample_does_not_fit, states_do_not_fit
from dcparallel.plan.types import REL_TOL, Fit, MicroBatch, NoLayoutFits
from dcparallel.spec import STATIC_MODES, ClusterSpec, Layout, Recompute, Size, Workload, batch_key
from dcparallel.topology import Topology

#: How a policy picks recompute: a `spec.STATIC_MODES` setting fixed for every layer,
#: "fit" = the fastest of those four that fits, per micro-batch, "pac" = the fastest
#: per-layer split that fits (knapsack over layers x {attention, MLP}).
RecomputeMode = Literal["none", "attn", "mlp", "full", "fit", "pac"]

#: the baselines' largest micro-batch of one size (`bucket`; the calibration measured up to 64)
MAX_MBS = 64
#: the most copies of one size `dcp` puts in a micro-batch (`bucket_options`, its class tables):
#: a model of a few million parameters on small images or short documents is launch-bound far
#: past 64 (its per-sample time still falls at hundreds), as `packed`'s bins of one shape show
MAX_COPIES = 512
_LAYOUT, _IDS, _SP = attrgetter("layout"), attrgetter("sample_ids"), attrgetter("sp")
_RECOMPUTE, _ATTN, _MLP = attrgetter("recompute"), attrgetter("attn"), attrgetter("mlp")
GRID_MIN = 16  # `mb_costs` prices fewer of a degree one at a time (cached): one grid costs about as much


def mbs_candidates(top: int, most: int = MAX_MBS) -> list[int]:
    """Micro-batch sizes the planners try up to `top`: the powers of two up to `most`, and `top`."""
    return sorted({m for m in (1 << i for i in range(most.bit_length())) if m <= top} | {top})


@dataclass(frozen=True, slots=True)
class Option:
    """A layout for a bucket's micro-batches with its time (of a full micro-batch of the
    bucket's largest sample) and GPU-seconds per sample."""

    layout: Layout
    time: float

    @property
    def gpu_s_per_sample(self) -> float:
        return self.time * self.layout.sp / self.layout.mbs


class FitGrid(NamedTuple):
    """`PlanContext.layout_for` of many micro-batches at many SP degrees, as arrays of one
    shape: the time (inf where nothing fits) and the recompute counts (-1 there)."""

    time: np.ndarray
    attn: np.ndarray
    mlp: np.ndarray


class PlanContext:
    def __init__(
        self,
        workload: Workload,
        cost: CostModel,
        cluster: ClusterSpec,
        sp_sizes: Sequence[int] | None = None,
        skip_oversize: bool = False,
        layouts: dict | None = None,
    ):
        if cost.model != workload.model:
            raise ValueError(f"cost model is for {cost.model.name!r}, workload for {workload.model.name!r}")
        if cost.cluster.shard_size != cluster.shard_size:
            raise ValueError(
                f"the cost model prices shard blocks of {cost.cluster.shard_size} ranks but the cluster "
                f"plans for {cluster.shard_size}; build the cost model on the same ClusterSpec"
            )
        self.workload, self.cost, self.cluster = workload, cost, cluster
        if hasattr(cost, "longest_sample"):  # a longer sequence it prices is a packed bin: its warning says so
            cost.longest_sample = max(cost.longest_sample, max(workload.tokens, default=0))
        self.model = workload.model
        self.budget = float(cluster.memory_bytes)
        #: the group geometry every planner places its groups with (sizes past the heads with ring)
        self.topology = Topology.of(cluster, self.model.num_heads)
        supported = cost.sp_sizes

        def usable(sizes: Sequence[int]) -> list[int]:
            return [
                k for k in sizes if (supported is None or k in supported) and (sp_sizes is None or k in set(sp_sizes))
            ]

        chain = usable(self.topology.chain)
        if not chain:
            raise ValueError(
                f"no usable SP degree: chain {list(self.topology.chain)}, "
                f"cost model supports {supported}, asked for {sp_sizes}"
            )
        #: the SP degrees the planners use: the topology's chain (groups of any mix of them tile
        #: the world), less those the cost model cannot price or the caller left out
        self.sp_sizes: list[int] = chain
        #: the degrees `dcp` mixes (`Topology.mix`, filtered the same way): the chain, and on
        #: nodes whose sizes are not one chain the other sizes inside a node too; the lower
        #: bounds take these
        self.mix_sizes: list[int] = usable(self.topology.mix)
        self.sizes = workload.sizes
        self.tokens = workload.tokens
        #: the class a micro-batch's samples share (`spec.batch_key`: video, one latent shape)
        self.bucket_of: list[tuple[int, ...]] = [batch_key(self.model, s) for s in self.sizes]
        self._fit: dict = {} if layouts is None else layouts  # `copies_layout`'s; given: shared (`plan.reuse`)
        self._mixed: dict = {}  # any micro-batch: bounded, see cost.base.cache_put
        self._options: dict = {}
        self._preferred: dict = {}
        self._tokens: np.ndarray | None = None  # see `token_array`
        self._bucket_pos: tuple[list, np.ndarray] | None = None  # see `bucket_positions`
        self._sample_stats: tuple | None = None  # see `batches`
        self.skipped: list[tuple[int, Size, float]] = []
        self._check_fit(skip_oversize)
        members: dict[tuple[int, ...], list[int]] = {}
        for i in self.usable_ids:  # skipped samples must not size (or empty) their bucket
            members.setdefault(self.bucket_of[i], []).append(i)
        #: the largest usable sample of each bucket (`cost.vision.class_rep`): its layouts must fit it
        self.rep: dict[tuple[int, ...], Size] = {
            b: class_rep([self.sizes[i] for i in ids], [self.tokens[i] for i in ids]) for b, ids in members.items()
        }

    # -- cost access -------------------------------------------------------------------
    def terms(self, sizes: tuple[Size, ...], sp: int) -> MicroBatchTerms:
        return self.cost.terms(sizes, sp)  # the cost models cache their terms

    def copies_layout(self, size: Size, count: int, sp: int, mode: RecomputeMode) -> Fit | None:
        """`layout_for` of `count` copies of one size (how bucket layouts are sized)."""
        key = (size, count, sp, mode)
        hit = self._fit.get(key, 0)
        if hit != 0:
            return hit
        terms = self.cost.terms_copies(size, count, sp)
        r = self.recompute_for(terms, mode)
        out = None if r is None else Fit(Layout(sp, count, r), terms.time(r))
        self._fit[key] = out
        return out

    def copies_times(
        self, sizes: Sequence[Size], tops: Sequence[int], sp: int, mode: RecomputeMode
    ) -> list[np.ndarray]:
        """Per size of ``sizes``, `copies_layout(size, m, sp, mode).time` for m = 1..its top,
        all priced at once (`CostModel.terms_copies_grid`, `recompute_grid`): the same times,
        element by element; inf where m copies do not fit. Not cached."""
        counts = np.concatenate([np.arange(1, top + 1, dtype=np.int64) for top in tops] or [np.zeros(0, np.int64)])
        terms = self.cost.terms_copies_grid([s for s, top in zip(sizes, tops) for _ in range(top)], counts, sp)
        attn, mlp = self.recompute_grid(terms, mode)
        ok = attn >= 0
        times = np.where(ok, terms.time(np.where(ok, attn, 0), np.where(ok, mlp, 0)), np.inf)[:, 0]
        return np.split(times, np.cumsum(tops)[:-1])

    def recompute_for(self, terms: MicroBatchTerms, mode: RecomputeMode) -> Recompute | None:
        """The recompute setting `mode` picks for a micro-batch, or None if it cannot fit."""
        L = self.model.num_layers
        if mode == "pac":
            return terms.cheapest_recompute(self.budget)
        if mode == "fit":  # the fastest whole-model setting that fits
            fits = [r for r in (Recompute.static(m, L) for m in STATIC_MODES) if terms.memory(r) <= self.budget]
            return min(fits, key=terms.time) if fits else None
        r = Recompute.static(mode, L)
        return r if terms.memory(r) <= self.budget else None

    def layout_for(self, sizes: tuple[Size, ...], sp: int, mode: RecomputeMode) -> Fit | None:
        """The layout (with recompute per `mode`) of a micro-batch of these samples at `sp`
        and its time, or None if it does not fit."""
        key = (sizes, sp, mode)
        hit = self._mixed.get(key, 0)
        if hit != 0:
            return hit
        terms = self.terms(sizes, sp)
        r = self.recompute_for(terms, mode)
        return cache_put(self._mixed, key, None if r is None else Fit(Layout(sp, len(sizes), r), terms.time(r)))

    def batches(self, micro_batches: Sequence[Sequence[int]]) -> Batches:
        """Micro-batches (sample ids) as the cost models' `Batches`."""
        if self._sample_stats is None:  # each sample's tokens, pairs and vision patches, once
            pairs = {s: float(self.model.attention_pairs(s)) for s in set(self.sizes)}
            self._sample_stats = (
                self.token_array(),
                np.fromiter(map(pairs.__getitem__, self.sizes), dtype=float, count=len(self.sizes)),
                vision_stats(self.model, self.sizes),
            )
        tokens, pairs_of, vision = self._sample_stats
        ids = np.fromiter(chain.from_iterable(micro_batches), dtype=np.int64)
        return Batches(
            tokens[ids],
            pairs_of[ids],
            np.fromiter(map(len, micro_batches), dtype=np.int64, count=len(micro_batches)),
            None if vision is None else vision[ids],
        )

    def fits_grid(self, micro_batches: Sequence[Sequence[int]], sps: Sequence[int], mode: RecomputeMode) -> FitGrid:
        """`layout_for` of every micro-batch (its sample ids) at every degree of `sps`,
        priced at once (`CostModel.terms_grid`), arrays of shape (len(micro_batches),
        len(sps)): the same times and recompute counts, element by element. Not cached: a
        step's candidate micro-batches rarely repeat."""
        terms = self.cost.terms_grid(self.batches(micro_batches), sps)
        attn, mlp = self.recompute_grid(terms, mode)
        ok = attn >= 0
        return FitGrid(np.where(ok, terms.time(np.where(ok, attn, 0), np.where(ok, mlp, 0)), np.inf), attn, mlp)

    def recompute_grid(self, terms: TermsArray, mode: RecomputeMode) -> tuple[np.ndarray, np.ndarray]:
        """`recompute_for` of each element: the counts (attn, mlp), -1 where nothing fits."""
        if mode == "pac":
            return terms.cheapest_recompute(self.budget)
        L = self.model.num_layers
        attn = np.full(terms.shape, -1, dtype=np.int64)
        mlp = np.full(terms.shape, -1, dtype=np.int64)
        best_t = np.full(terms.shape, np.inf)
        for m in STATIC_MODES if mode == "fit" else (mode,):
            r = Recompute.static(m, L)
            fits = terms.memory(r.attn, r.mlp) <= self.budget
            if mode == "fit":  # the first of least time among those that fit, as min() picks
                t = terms.time(r.attn, r.mlp)
                fits &= (attn < 0) | (t < best_t)
                best_t = np.where(fits, t, best_t)
            attn[fits] = r.attn
            mlp[fits] = r.mlp
        return attn, mlp

    def max_mbs(self, size: Size, sp: int, mode: RecomputeMode, cap: int = MAX_MBS) -> int:
        """Largest micro-batch of copies of `size` that fits at `sp` with `mode` (0 if none)."""
        if self.copies_layout(size, 1, sp, mode) is None:
            return 0
        lo, hi = 1, 1
        while hi < cap and self.copies_layout(size, min(2 * hi, cap), sp, mode) is not None:
            lo = hi = min(2 * hi, cap)
        if hi == cap:
            return cap
        hi = min(2 * hi, cap)  # lo fits, hi does not: bisect
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.copies_layout(size, mid, sp, mode) is not None:
                lo = mid
            else:
                hi = mid
        return lo

    def most_copies(self, size: Size, sp: int, mode: RecomputeMode) -> int:
        """The largest micro-batch of copies of `size` `dcp` tries at `sp`: `max_mbs` up to
        `MAX_COPIES`."""
        return self.max_mbs(size, sp, mode, cap=MAX_COPIES)

    def fewest_gpu_seconds(self, size: Size, sp: int, top: int) -> float:
        """The fewest GPU-seconds per sample (time * sp / m) of m = 1..top copies of `size` at
        `sp`, with the fastest recompute that fits ("pac"; `top`: `max_mbs`). Any m, not only the
        powers of two the planners try: the cost per sample falls as m grows but jumps where the
        micro-batch must recompute more (6 copies keep everything, 7 recompute), so its least is
        often between two powers of two. Those and top are priced; the m between two priced ones
        are skipped where `_floor_between` proves none costs less, else the interval is halved."""
        cands = mbs_candidates(top)
        best = min(self.copies_layout(size, m, sp, "pac").time / m for m in cands)
        terms: dict[int, MicroBatchTerms] = {}
        todo = list(zip(cands, cands[1:]))
        while todo:
            a, b = todo.pop()
            if b - a < 2:
                continue
            for m in (a, b):
                if m not in terms:
                    terms[m] = self.cost.terms_copies(size, m, sp)
            if _floor_between(terms[a], terms[b], a, b, self.budget, best) >= best * (1 - 1e-12):
                continue
            mid = (a + b) // 2
            best = min(best, self.copies_layout(size, mid, sp, "pac").time / mid)
            todo += [(a, mid), (mid, b)]
        return best * sp

    def bucket_options(self, bucket: tuple[int, int], mode: RecomputeMode) -> dict[int, Option]:
        """Per SP degree, the layout of least GPU-seconds per sample for this bucket (over
        micro-batch sizes 1, 2, 4, ... up to the largest that fits, at most `MAX_COPIES`)."""
        key = (bucket, mode)
        hit = self._options.get(key)
        if hit is not None:
            return hit
        size = self.rep[bucket]
        out: dict[int, Option] = {}
        for k in self.sp_sizes:
            top = self.most_copies(size, k, mode)
            if top == 0:
                continue
            best = None
            for mbs in mbs_candidates(top, MAX_COPIES):
                fit = self.copies_layout(size, mbs, k, mode)
                assert fit is not None
                opt = Option(fit.layout, fit.time)
                if best is None or opt.gpu_s_per_sample < best.gpu_s_per_sample * (1 - REL_TOL):
                    best = opt
            if best is not None:
                out[k] = best
        self._options[key] = out
        return out

    def preferred(self, bucket: tuple[int, ...], mode: RecomputeMode) -> Option:
        """The bucket's preferred layout: of `bucket_options`, the one of fewest GPU-seconds per
        sample, the narrowest SP degree on ties; cached."""
        key = (bucket, mode)
        hit = self._preferred.get(key)
        if hit is None:
            opts = self.bucket_options(bucket, mode)
            hit = self._preferred[key] = opts[min(opts, key=lambda k: (opts[k].gpu_s_per_sample, k))]
        return hit

    def mb_terms(self, sample_ids: Sequence[int], sp: int) -> MicroBatchTerms:
        return self.terms(tuple(self.sizes[i] for i in sample_ids), sp)

    def mb_costs(
        self, micro_batches: Sequence[MicroBatch], memory: bool = True
    ) -> tuple[list[float], list[float] | None]:
        """`mb_time` and `mb_memory` of each micro-batch at its layout, priced per SP degree
        at once (`CostModel.terms_grid`; one at a time below `GRID_MIN` of a degree): the
        same values either way, element by element. Without `memory`, the times alone
        (memory None: a step's score reads no memory). The micro-batches' degrees, recompute
        counts and samples are read into arrays once; each degree's are picked from them."""
        n = len(micro_batches)
        layouts = list(map(_LAYOUT, micro_batches))
        sps = np.fromiter(map(_SP, layouts), dtype=np.int64, count=n)
        recs = list(map(_RECOMPUTE, layouts))
        attn = np.fromiter(map(_ATTN, recs), dtype=np.int64, count=n)[:, None]
        mlp = np.fromiter(map(_MLP, recs), dtype=np.int64, count=n)[:, None]
        ids = list(map(_IDS, micro_batches))
        times, mem = np.zeros(n), np.zeros(n) if memory else None
        batches = None
        for sp in np.unique(sps).tolist():
            js = np.flatnonzero(sps == sp)
            if len(js) < GRID_MIN:
                for j in js.tolist():
                    terms1 = self.mb_terms(ids[j], sp)
                    times[j] = terms1.time(layouts[j].recompute)
                    if memory:
                        mem[j] = terms1.memory(layouts[j].recompute)
                continue
            if batches is None:  # every micro-batch's samples, once
                batches = self.batches(ids)
            terms = self.cost.terms_grid(batches.subset(js), (sp,))
            times[js] = terms.time(attn[js], mlp[js])[:, 0]
            if memory:
                mem[js] = terms.memory(attn[js], mlp[js])[:, 0]
        return times.tolist(), mem.tolist() if memory else None

    def mb_time(self, sample_ids: Sequence[int], layout: Layout) -> float:
        return self.mb_terms(sample_ids, layout.sp).time(layout.recompute)

    def mb_memory(self, sample_ids: Sequence[int], layout: Layout) -> float:
        return self.mb_terms(sample_ids, layout.sp).memory(layout.recompute)

    def bucket_positions(self) -> tuple[list[tuple[int, ...]], np.ndarray]:
        """Every bucket of the workload in key order, and each sample's bucket's position
        among them (an int64 array over all samples, skipped ones included); made when first
        asked and shared by the planners of this context."""
        if self._bucket_pos is None:
            keys = sorted(set(self.bucket_of))
            pos = {b: j for j, b in enumerate(keys)}
            at = np.fromiter(map(pos.__getitem__, self.bucket_of), dtype=np.int64, count=len(self.bucket_of))
            at.flags.writeable = False  # shared: read, never written
            self._bucket_pos = (keys, at)
        return self._bucket_pos

    def token_array(self) -> np.ndarray:
        """Each sample's tokens as an int64 array (skipped samples included); made when first
        asked and shared by the planners of this context."""
        if self._tokens is None:
            self._tokens = np.asarray(self.tokens, dtype=np.int64)
            self._tokens.flags.writeable = False  # shared: read, never written
        return self._tokens

    def step_tokens(self, sample_ids: Sequence[int] | np.ndarray) -> int:
        """The tokens of a step's samples (the ids as a sequence or an integer array)."""
        ids = (
            sample_ids
            if isinstance(sample_ids, np.ndarray)
            else np.fromiter(sample_ids, dtype=np.int64, count=len(sample_ids))
        )
        return int(self.token_array()[ids].sum())

    # -- validation --------------------------------------------------------------------
    def _check_fit(self, skip_oversize: bool) -> None:
        """Every sample must fit some layout: the largest SP degree with full recompute."""
        k = self.sp_sizes[-1]
        L = self.model.num_layers
        bad: list[tuple[int, Size, float]] = []  # (sample id, size, bytes it needs)
        checked: dict[Size, float | None] = {}
        for i, s in enumerate(self.sizes):
            if s not in checked:
                terms = self.terms((s,), k)
                need = terms.memory(Recompute(L, L))
                checked[s] = None if need <= self.budget else need
            need = checked[s]
            if need is not None:
                bad.append((i, s, need))
        states = self.cost.model_state_bytes()
        if states >= self.budget and bad:
            raise NoLayoutFits(states_do_not_fit(states, self.budget, self.cluster.shard_size))
        if bad and not skip_oversize:
            i, s, need = max(bad, key=lambda b: (b[2], -b[0]))
            raise NoLayoutFits(
                sample_does_not_fit(
                    i, s, self.tokens[i], k, need, states, self.budget, len(bad), self.cluster.shard_size
                )
            )
        self.skipped = bad
        if bad:
            skip = {i for i, _, _ in bad}
            self.usable_ids = [i for i in range(len(self.sizes)) if i not in skip]
        else:
            self.usable_ids = list(range(len(self.sizes)))


def _floor_between(ta: MicroBatchTerms, tb: MicroBatchTerms, a: int, b: int, budget: float, stop: float) -> float:
    """A floor on the time per sample of m copies of one size, for every m from a to b (terms
    `ta`, `tb`) inside one interval between powers of two. There each term of the time (without
    recompute, and each kind's recompute time) per sample is monotone in m (both cost models are
    affine or falling there), so it is at least its smaller end; and a recompute setting that
    fits m copies fits a copies. So the fastest setting that fits a copies, timed with those
    smaller ends, is a floor: the knapsack, or its fractional relaxation if that reaches `stop`."""
    ends = {k: min(getattr(ta, k) / a, getattr(tb, k) / b) for k in ("time_none", "dt_attn", "dt_mlp", "dt_full")}
    if ta.memory(Recompute(0, 0)) <= budget:
        return ends["time_none"]  # nothing need be recomputed, and recomputing adds time
    need = ta.fixed_bytes + ta.num_layers * ta.act_layer + ta.transient_rec - budget  # bytes to save
    rates = [
        dt / save
        for dt, save in (
            (ends["dt_attn"], ta.save_attn),
            (ends["dt_mlp"], ta.save_mlp),
            (ends["dt_full"], ta.save_full),
        )
        if save > 0
    ]
    relaxed = ends["time_none"] + max(need, 0.0) * min(rates, default=0.0)
    if relaxed >= stop:
        return relaxed
    floor = dataclasses.replace(ta, **ends)
    r = floor.cheapest_recompute(budget)
    return math.inf if r is None else floor.time(r)
