"""ProfiledCost: the cost model over a measured profile (`cost.schema.Profile`).

Per (bucket, SP degree, recompute mode) the profile holds measured micro-batch sizes; a
micro-batch of any sizes is priced by interpolating linearly in micro-batch size and in
tokens between measured buckets, and the terms of every recompute setting follow from the
four whole-model modes. The model is kept monotone, as the lower bound needs: measured times
and memory never fall as the micro-batch grows, and a micro-batch of mixed sizes costs at least
what the copies of any one of its sizes cost alone.

A vision-language sample (`VisionSize`) is priced where the profile holds its tower measured
per patch bucket (`Profile.vision`) and the model spec its `VisionTower`: the language model
from its tokens as above, plus the tower's time and kept bytes by `cost.vision.VisionPrice`
fitted to the measurement; without such a table it is refused.

With ring (`ClusterSpec.ring`) a profile of this launch holds the sizes past the heads too,
and each size above one at two splits (`Topology.profiled_splits`: the largest Ulysses
degree, `Topology.measured_split`, and all-ring); each entry carries its ring degree (an
entry without one is its size's measured split). Each split's entries are priced as above,
on their own tables; a micro-batch at a size is priced at the split whose price for it is
least, and `best_split` names that split, so a plan runs what was measured fastest.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
from collections import Counter
from typing import Sequence

from dcparallel.cost.base import MicroBatchTerms, cache_put, gathered_bytes, grad_sync_time
from dcparallel.cost.batch import Batches, TermsArray
from dcparallel.cost.ring import SplitTime, check_ring
from dcparallel.cost.schema import Profile, ProfileEntry
from dcparallel.cost.shard import ShardComm
from dcparallel.cost.vision import VisionPrice, sample_vision
from dcparallel.spec import STATIC_MODES, ClusterSpec, Size, VisionSize
from dcparallel.topology import Topology

log = logging.getLogger(__name__)


def _non_decreasing(points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """Measured (micro-batch size, time, memory) with time and memory made non-decreasing in
    the size (a running maximum). More samples never take less time or memory; a measurement
    that says so is timing noise (warm-up, clocks), and taken at face value it would let a
    planner beat the lower bound, which times a sample alone."""
    out, t_max, m_max = [], 0.0, 0.0
    for n, t, m in points:
        t_max, m_max = max(t_max, t), max(m_max, m)
        out.append((n, t_max, m_max))
    return out


class ProfiledCost:
    """Cost model over a `Profile`, for a cluster whose world size the profile measured.
    ``time_at`` prices every measured layout at its time ("value"), or at the low or high end
    of its interval (`ProfileEntry.time_range`): the simulator replays a plan under both ends
    to give the spread of its prediction."""

    def __init__(self, profile: Profile, cluster: ClusterSpec, time_at: str = "value"):
        if time_at not in ("value", "low", "high"):
            raise ValueError(f"time_at={time_at!r}; choose 'value', 'low' or 'high'")
        self.profile, self.model, self.cluster = profile, profile.model, cluster
        self.time_at = time_at
        check_ring(profile.model, cluster)
        if profile.world_size != cluster.world_size:
            raise ValueError(
                f"the profile was measured at world size {profile.world_size} but the cluster has "
                f"{cluster.world_size} ranks; SP groups and the gradient sync differ: profile at "
                f"this world size (dcparallel profile, or prepare() on this launch)"
            )
        self._state, self._sync, self._shard = profile.model_state_bytes, profile.grad_sync_s, None
        if cluster.shard_size != profile.shard_size:
            self._reshard(profile, cluster)
        tokens = {b.key: b.tokens for b in profile.buckets}
        self.token_range = (min(tokens.values()), max(tokens.values())) if tokens else (0, 0)
        self._topology = Topology.of(cluster, profile.model.num_heads)
        primary, others = self._by_split(profile.entries)
        self._tables(primary, tokens)
        self._warned_range = False
        #: tokens of the longest sample of the workloads planned with this cost model (`PlanContext`
        #: notes it): a longer sequence priced is a packed bin of several samples
        self.longest_sample = 0
        self._cache: dict = {}
        #: ring degree -> the same cost model over the entries measured at that other split
        self._alts: dict[int, ProfiledCost] = {}
        for ring, entries in sorted(others.items()):
            alt = copy.copy(self)
            alt.reprice(entries, tokens)
            self._alts[ring] = alt
        #: the tower priced from the profile's measurement; None: vision-language samples refused
        self._vision = None
        if profile.vision is not None and self.model.vision is not None:
            self._vision = VisionPrice.from_table(self.model.vision, profile.vision)
        if time_at == "value":
            profile.warn_if_noisy(log)  # once per profile and process, not per cost object

    def _by_split(self, entries: Sequence[ProfileEntry]) -> tuple[list[ProfileEntry], dict[int, list[ProfileEntry]]]:
        """The entries at each size's `Topology.measured_split` (those without a ring degree,
        and those of a size that no split of this world offers), and
        by ring degree those at another split this cluster can run; a split it cannot run
        (ring measured, the cluster without ring) is not priced."""
        profiled = Topology.of(self.cluster, self.model.num_heads, ring=True)  # the splits a profile measures
        primary: list[ProfileEntry] = []
        others: dict[int, list[ProfileEntry]] = {}
        for e in entries:
            measured = profiled.splits(e.sp)
            if e.ring is None or not measured or e.ring == measured[-1][1]:
                primary.append(e)
            elif (e.sp // e.ring, e.ring) in self._topology.splits(e.sp):
                others.setdefault(e.ring, []).append(e)
        return primary, others

    def reprice(self, entries: Sequence[ProfileEntry], tokens: dict[str, int]) -> None:
        """This cost model priced from ``entries`` instead of its own (a copy's tables for
        another split of the same SP sizes), with an empty cache and no other splits."""
        self._cache, self._alts = {}, {}
        self._tables(entries, tokens)

    def _tables(self, entries: Sequence[ProfileEntry], tokens: dict[str, int]) -> None:
        """The interpolation tables of ``entries`` (one split per size)."""
        time_at = self.time_at
        #: (sp, mode) -> the fewest tokens at which one sample did not fit
        self._unfit: dict[tuple[int, str], int] = {}
        # (sp, mode) -> sorted list of (tokens, bucket key); (bucket, sp, mode) -> sorted [(mbs, t, mem)]
        self._points: dict[tuple[str, int, str], list[tuple[int, float, float]]] = {}
        for e in entries:
            if not e.feasible or e.time_s is None or e.memory_bytes is None:
                if e.mbs == 1:
                    k = (e.sp, e.recompute)
                    self._unfit[k] = min(self._unfit.get(k, tokens[e.bucket]), tokens[e.bucket])
                continue
            t = float(e.time_s) if time_at == "value" else e.time_range()[0 if time_at == "low" else 1]
            self._points.setdefault((e.bucket, e.sp, e.recompute), []).append((e.mbs, t, float(e.memory_bytes)))
        for key, v in self._points.items():
            self._points[key] = _non_decreasing(sorted(v))
        self._by_tokens: dict[tuple[int, str], list[tuple[int, str]]] = {}
        for bucket, sp, mode in self._points:
            self._by_tokens.setdefault((sp, mode), []).append((tokens[bucket], bucket))
        for v in self._by_tokens.values():
            v.sort()
        self.sp_sizes = sorted(
            {sp for sp, mode in self._by_tokens if mode == "none" or mode == "full"} | {sp for sp, mode in self._unfit}
        )

    def _reshard(self, profile: Profile, cluster: ClusterSpec) -> None:
        """Plans shard blocks of ``cluster.shard_size`` ranks from a profile measured without
        them: parameters and gradients (the model's parameter bytes + 4 fp32 gradient bytes per
        parameter) shrink to 1/s and the gathered parameters are added (`base.gathered_bytes`);
        the block's collectives (`cost.shard`) and the replicas' gradient sync are priced on the
        cluster's links. A profile measured at another shard size is refused."""
        s, m = cluster.shard_size, profile.model
        if profile.shard_size != 1:
            raise ValueError(
                f"the profile was measured at shard size {profile.shard_size} but the cluster plans for "
                f"shard size {s}; profile at this shard size (or at 1, which any shard size can use)"
            )
        if cluster.world_size > 1 and cluster.intra_bw <= 0 or cluster.num_nodes > 1 and cluster.inter_bw <= 0:
            raise ValueError(
                f"cluster {cluster.name!r} has no link bandwidth (intra_bw={cluster.intra_bw}, "
                f"inter_bw={cluster.inter_bw}); pricing shard blocks of {s} ranks from an unsharded "
                f"profile needs both: set them in bytes/s (spec.h200_cluster has datasheet values)"
            )
        sharded = (m.num_params * m.bytes_per_value + 4 * m.trainable_params) * (1 - 1 / s)
        self._state = profile.model_state_bytes - sharded + gathered_bytes(m)
        self._sync = grad_sync_time(m, cluster)
        self._shard = ShardComm.of(m, cluster)

    def grad_sync_time(self) -> float:
        return self._sync

    def model_state_bytes(self) -> float:
        return self._state

    def best_split(self, sizes: Sequence[Size], sp: int) -> SplitTime:
        """The (Ulysses, ring) split of a group of ``sp`` ranks the micro-batch of ``sizes`` is
        priced at (`terms`): among the splits the profile measured at ``sp``, the one predicted
        fastest for it (`_fastest`); the size's `Topology.measured_split` where it measured
        one. Its communication is inside the measured time, so the returned times are zero."""
        if any(sp in alt.sp_sizes for alt in self._alts.values()):
            ring = self._fastest(Counter(self.model.tokens(s) for s in sizes), sp)[0]
        else:
            ring = 0
        ring = ring or self._topology.measured_split(sp)[1]
        return SplitTime(sp // ring, ring, 0.0, 0.0, 0.0, 0.0)

    def add_state_bytes(self, extra: float) -> None:
        """Bytes every micro-batch finds allocated on top of the model states counted so far
        (FSDP's whole gradients held between micro-batches: `cost.grad_hold`)."""
        self._state += float(extra)
        self._cache.clear()
        for alt in self._alts.values():
            alt.add_state_bytes(extra)

    def _at(self, bucket: str, sp: int, mode: str, n: int) -> tuple[float, float]:
        """(time, memory) per sample of a micro-batch of n samples of `bucket`: interpolated
        linearly in n between measured micro-batch sizes; beyond the largest, extended by the
        marginal cost of one more sample between the last two (a micro-batch's fixed cost,
        launches and all-to-all latency, is paid once, not per sample); proportional when
        there is a single measurement."""
        pts = self._points[(bucket, sp, mode)]
        ns = [p[0] for p in pts]
        i = bisect.bisect_left(ns, n)
        if i < len(pts) and ns[i] == n:
            _, t, m = pts[i]
        elif i == 0:
            _, t, m = pts[0]
            t, m = t * n / ns[0], m * n / ns[0]
        elif i == len(pts) and len(pts) == 1:
            _, t, m = pts[-1]
            t, m = t * n / ns[-1], m * n / ns[-1]
        elif i == len(pts):
            (n0, t0, m0), (n1, t1, m1) = pts[-2], pts[-1]
            # marginal cost, never below zero nor above the average of the last point
            dt = min(max(t1 - t0, 0.0) / (n1 - n0), t1 / n1)
            dm = min(max(m1 - m0, 0.0) / (n1 - n0), m1 / n1)
            t, m = t1 + (n - n1) * dt, m1 + (n - n1) * dm
        else:
            (n0, t0, m0), (n1, t1, m1) = pts[i - 1], pts[i]
            w = (n - n0) / (n1 - n0)
            t, m = t0 + w * (t1 - t0), m0 + w * (m1 - m0)
        return t / n, m / n

    def _per_sample(self, tokens: int, sp: int, mode: str, n: int) -> tuple[float, float] | None:
        """Per-sample (time, memory) for a sample of `tokens` in a micro-batch of n, interpolated
        linearly in tokens between the nearest measured buckets; proportional beyond the largest.
        Below the smallest, memory is proportional and time is the smallest bucket's times
        `_short_share`."""
        row = self._by_tokens.get((sp, mode))
        if not row:
            return None
        toks = [r[0] for r in row]
        if tokens > 2 * self.token_range[1] and not self._warned_range:
            self._warned_range = True
            log.warning(
                "%s is far beyond the profiled range %d..%d tokens (profile of %r): its time and memory "
                "are extrapolated proportionally and may be wrong; %s",
                *self._beyond(tokens),
                self.model.name,
                self._beyond_fix(tokens),
            )
        i = bisect.bisect_left(toks, tokens)
        if i < len(row) and toks[i] == tokens:
            return self._at(row[i][1], sp, mode, n)
        if i == 0 or i == len(row):
            k0, b0 = row[0] if i == 0 else row[-1]
            t, m = self._at(b0, sp, mode, n)
            return t * (self._short_share(row, sp, mode, tokens) if i == 0 else tokens / k0), m * tokens / k0
        (k0, b0), (k1, b1) = row[i - 1], row[i]
        (t0, m0), (t1, m1) = self._at(b0, sp, mode, n), self._at(b1, sp, mode, n)
        w = (tokens - k0) / (k1 - k0)
        return t0 + w * (t1 - t0), m0 + w * (m1 - m0)

    def _beyond(self, tokens: int) -> tuple[str, int, int]:
        if self.longest_sample and tokens > self.longest_sample:
            what = (
                f"a packed bin of {tokens} tokens (the packed layout: several samples in one sequence; the longest "
                f"sample has {self.longest_sample})"
            )
        else:
            what = f"a sample of {tokens} tokens"
        return (what, *self.token_range)

    def _beyond_fix(self, tokens: int) -> str:
        if self.longest_sample and tokens > self.longest_sample:
            return (
                f"packed bins' prices rest on it (the packed policy's bin capacity, and whether dcp, which "
                f"also plans the packed layout on steps of few samples, keeps such a plan): for them priced by "
                f"measurement, profile buckets up to {tokens} tokens (dcparallel profile --buckets ...,{tokens})"
            )
        return (
            "profile buckets that cover these lengths (dcparallel profile --buckets ...; DataCentricParallel."
            "prepare profiles the dataset's own lengths once its cached profile is deleted)"
        )

    def _short_share(self, row: list[tuple[int, str]], sp: int, mode: str, tokens: int) -> float:
        """A sample shorter than the smallest bucket (k0 tokens): its time as a share of that
        bucket's, from the line through the two smallest buckets' times alone (one sample
        each), never below tokens / k0. A sample's fixed cost (launches, the loss) does not
        shrink with its tokens, and a proportional price makes a short sample alone look
        almost free. One share for every micro-batch size keeps a sample's price in a
        micro-batch of any size between its prices at the measured sizes, as the lower bound
        assumes (`plan.bounds`, A2)."""
        (k0, b0) = row[0]
        if len(row) < 2:
            return tokens / k0
        (k1, b1) = row[1]
        t0, t1 = self._at(b0, sp, mode, 1)[0], self._at(b1, sp, mode, 1)[0]
        if t0 <= 0:
            return tokens / k0
        return max(tokens / k0, 1.0 - (k0 - tokens) * max(0.0, t1 - t0) / (k1 - k0) / t0)

    def terms_copies(self, size: Size, count: int, sp: int) -> MicroBatchTerms:
        """`terms` of `count` copies of one size, in time independent of `count` (the
        planners probe micro-batch sizes up to thousands of copies)."""
        if self._vision is None:
            _refuse_vision((size,))
        tk = self.model.tokens(size)
        key = ("copies", tk, count, sp)
        hit = self._cache.get(key)
        terms = hit if hit is not None else cache_put(self._cache, key, self._terms({tk: count}, sp))
        if self._vision is None:
            return terms
        p, q, mp, mq = sample_vision(self.model.vision, size)
        return self._with_tower(terms, (count * p, count * q, mp, mq), sp)

    def terms_copies_grid(self, sizes: Sequence[Size], counts: Sequence[int], sp: int) -> TermsArray:
        """`terms_copies(sizes[i], counts[i], sp)` of every i, as arrays of shape (len(counts), 1):
        one at a time."""
        return TermsArray.stack([self.terms_copies(s, int(c), sp) for s, c in zip(sizes, counts)], (len(counts), 1))

    def terms_grid(self, batches: Batches, sps: Sequence[int]) -> TermsArray:
        """`terms` of every micro-batch at every degree, as arrays of shape (len(batches),
        len(sps)): through `terms`' own cache and arithmetic, one micro-batch and degree at a time."""
        if batches.vision is not None and self._vision is None:
            raise ValueError(_VISION_REFUSED)
        runs = list(batches.token_runs())
        vis = list(zip(*batches.vision_sums())) if batches.vision is not None else [None] * len(runs)
        out = [
            self._with_tower(self._cached(tuple(sorted(run)), sp), v, sp)
            for run, v in zip(runs, vis, strict=True)
            for sp in sps
        ]
        return TermsArray.stack(out, (len(batches), len(sps)))

    def terms(self, sizes: Sequence[Size], sp: int) -> MicroBatchTerms:
        if self._vision is None:
            _refuse_vision(sizes)
        terms = self._cached(tuple(sorted(self.model.tokens(s) for s in sizes)), sp)
        if self._vision is None:
            return terms
        stats = [sample_vision(self.model.vision, s) for s in sizes]
        return self._with_tower(
            terms,
            (sum(v[0] for v in stats), sum(v[1] for v in stats), max(v[2] for v in stats), max(v[3] for v in stats)),
            sp,
        )

    def _with_tower(self, terms: MicroBatchTerms, vis: tuple | None, sp: int) -> MicroBatchTerms:
        """``terms`` plus the tower's time and kept bytes of a micro-batch whose vision stats
        are ``vis`` (patches, pairs, the largest item's patches and pairs: `cost.vision`)."""
        if vis is None or self._vision is None or not vis[0]:
            return terms
        vp, vq = self._vision.rank_work(tuple(int(x) for x in vis), sp, False)
        return dataclasses.replace(
            terms,
            time_none=terms.time_none + self._vision.time(vp, vq),
            fixed_bytes=terms.fixed_bytes + self._vision.kept_bytes(vp, vq),
        )

    def _cached(self, toks: tuple[int, ...], sp: int) -> MicroBatchTerms:
        """`terms` of a micro-batch of samples of these token counts (sorted), cached."""
        key = (toks, sp)
        hit = self._cache.get(key)
        return hit if hit is not None else cache_put(self._cache, key, self._terms(Counter(toks), sp))

    def _terms(self, counts: dict[int, int], sp: int) -> MicroBatchTerms:
        """The terms of a micro-batch holding `counts[tokens]` samples of each token count, at
        the measured split predicted fastest for it (`_fastest`)."""
        return self._fastest(counts, sp)[1]

    def split_terms(self, counts: dict[int, int], sp: int) -> MicroBatchTerms:
        """The terms of a micro-batch from this object's own split's tables only (`_fastest`
        compares the other splits' copies through it)."""
        return self._terms_at(counts, sp)

    def _fastest(self, counts: dict[int, int], sp: int) -> tuple[int, MicroBatchTerms]:
        """(ring degree, terms) of the split of ``sp`` ranks whose measurements, interpolated
        for this micro-batch as every price is, give it the least time without recomputation
        (with full recomputation where keeping everything does not fit; infinite where no mode
        fits); ties to the size's measured split, whose ring degree is given as 0."""
        best = (0, self._terms_at(counts, sp))
        for ring, alt in self._alts.items():
            if sp in alt.sp_sizes:
                terms = alt.split_terms(counts, sp)
                if terms.time_none < best[1].time_none:
                    best = (ring, terms)
        return best

    def _terms_at(self, counts: dict[int, int], sp: int) -> MicroBatchTerms:
        """The terms of a micro-batch holding `counts[tokens]` samples of each token count, from
        this object's tables (one split per size)."""
        tot = self._mode_totals(counts, sp)
        if "none" not in tot and "full" not in tot and any(k[0] == sp for k in self._unfit):
            return _never_fits(self.model.num_layers)  # measured at this SP degree, and no mode fits
        if "none" not in tot and "full" not in tot:
            raise ValueError(f"the profile has no measurement at sp={sp}; measured sp sizes: {self.sp_sizes}")
        L = self.model.num_layers
        if "none" in tot:
            t_none, m_none = tot["none"]
            t_full, m_full = tot.get("full", (t_none, m_none))
        else:  # only full recomputation was feasible: keeping activations fits no budget
            t_full, m_full = tot["full"]
            t_none, m_none = t_full, m_full
        if self._shard is not None:  # a block's collectives, on top of the unsharded measurement
            extra = self._shard.exposed(t_none / L, L)
            t_none, t_full = t_none + extra, t_full + extra
            tot = {k: [v[0] + extra, v[1]] for k, v in tot.items()}

        # Recomputation adds work: a measured recompute faster than keeping everything is
        # timing noise, and taken at face value it would let a planner beat the lower bound
        # (which assumes recompute costs time). Such deltas count as zero.
        def delta(mode: str) -> tuple[float, float]:
            if mode not in tot or "none" not in tot:
                return 0.0, 0.0  # not measured: an option that saves nothing, never chosen
            return max(0.0, (tot[mode][0] - t_none) / L), (m_none - tot[mode][1]) / L

        dta, sva = delta("attn")
        dtm, svm = delta("mlp")
        return MicroBatchTerms(
            num_layers=L,
            time_none=t_none,
            dt_attn=dta,
            dt_mlp=dtm,
            dt_full=max(0.0, (t_full - t_none) / L),
            fixed_bytes=self._state,
            act_layer=m_none / L,
            save_attn=sva,
            save_mlp=svm,
            save_full=(m_none - m_full) / L,
            transient_none=0.0,
            transient_rec=0.0,
            keep_all_feasible="none" in tot,
        )

    def _mode_totals(self, counts: dict[int, int], sp: int) -> dict[str, list[float]]:
        """[seconds, bytes] of the micro-batch in each recompute mode it fits in (by the tables)."""
        n = sum(counts.values())
        largest = max(counts)
        tot: dict[str, list[float]] = {}
        for mode in STATIC_MODES:
            if largest >= self._unfit.get((sp, mode), float("inf")):
                continue  # measured: a sample this large does not fit in this mode
            acc = [0.0, 0.0]
            floor = [0.0, 0.0]
            for tk, count in counts.items():  # equal sizes once: copies of one size cost O(1)
                v = self._per_sample(tk, sp, mode, n)
                if v is None:
                    acc = None
                    break
                acc[0] += count * v[0]
                acc[1] += count * v[1]
                if count < n:  # this size's copies alone
                    alone = self._per_sample(tk, sp, mode, count)
                    floor = [max(floor[0], count * alone[0]), max(floor[1], count * alone[1])]
            if acc is not None:
                # a micro-batch takes at least the time and memory of any of its sizes' copies
                # alone: per-sample shares priced at the whole micro-batch's size amortize a
                # long sample's fixed cost over short ones, which would make adding samples
                # shorten a micro-batch (and let a plan beat the lower bound's longest sample)
                tot[mode] = [max(acc[0], floor[0]), max(acc[1], floor[1])]
        return tot


def _never_fits(num_layers: int) -> MicroBatchTerms:
    """Terms of a micro-batch no recompute mode fits: infinite memory, never planned."""
    return MicroBatchTerms(
        num_layers=num_layers,
        time_none=float("inf"),
        dt_attn=0.0,
        dt_mlp=0.0,
        dt_full=0.0,
        fixed_bytes=float("inf"),
        act_layer=0.0,
        save_attn=0.0,
        save_mlp=0.0,
        save_full=0.0,
        transient_none=0.0,
        transient_rec=0.0,
        keep_all_feasible=False,
    )


_VISION_REFUSED = (
    "this profile measures the language model only, not a vision tower: a vision-language sample "
    "(VisionSize) would be priced without its images; profile the model with prepare (which measures "
    "a Qwen-VL tower per patch bucket) or plan it with AnalyticCost (simulate without --profile), "
    "whose model prices the tower from each image's patches"
)


def _refuse_vision(sizes: Sequence[Size]) -> None:
    if any(type(s) is VisionSize for s in sizes):
        raise ValueError(_VISION_REFUSED)
