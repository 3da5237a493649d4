"""`dcp`'s class level (`ClassLevelPlanner`): a step planned over what is distinct in it —
(bucket, count) pairs and classes of alike groups — not over its samples.

Samples of one bucket are interchangeable for planning: a bucket's micro-batch is timed and
laid out (SP degree, micro-batch size, PAC recompute) for copies of the bucket's largest
sample, so it fits every sample of the bucket. Per step:

1. **Layouts by a makespan target.** For a target T, every bucket of the step takes the
   layout of least GPU-seconds whose micro-batch finishes within T (so a small T widens SP
   and shrinks micro-batches: the few-samples-per-GPU regime; a large T keeps the
   efficient narrow layouts); the groups each SP degree needs are estimated from its work
   and its micro-batches longer than T / 2. The smallest T whose groups fit the world is
   found among the distinct micro-batch times (`search`: a coarse pass, then the
   bracket it leaves), once per smallest allowed SP degree (forcing every bucket to at
   least that degree lets one phase hold a world-wide sample and the rest). The targets of
   every part (whole step, two-phase splits) at the three narrowest smallest degrees are one
   batch of array operations per pass; a part that goes on searches the rest in its own.
   Work that a floor (`search.plan_floor`, `rows_floor`) proves cannot change the plans
   kept, or the candidates expanded, is skipped: the plans are those of the full search. A
   step whose one-phase plan is above its bound is searched again with the micro-batches
   also capped below T (`config.cap_fractions`: many shapes of a few samples each share groups).
2. **Groups as classes.** The groups of one SP degree are alike until they get work: a
   degree's micro-batches (classes of equal time) are dealt to *group classes* — a load,
   a number of groups, their contents — by the longest-processing-time rule applied to
   whole classes; ranks left over go to the degree that finishes last while that helps.
3. **Two phases**: the step's wide micro-batches first, then the narrow ones on their own
   groups over the same ranks, for each split degree; kept when predicted faster.
4. **Expansion** (`expand`): the best few class-level plans become sample ids, are
   refined with each micro-batch's own time, and the one predicted fastest is kept; least
   floor first, one whose floor (`search.expanded_floor`) is above a prediction made is skipped.

The SP degrees are `PlanContext.mix_sizes`: the topology's chain, and where the sizes inside a
node are not one chain (SP 3 and 6 beside 2 and 4 on 12-GPU nodes) those too; then a degree gets
another group only where `Topology.fits` places it, and the step is also planned on the chain
alone (`portfolio.ChainAlone`), the plan predicted faster kept.
"""

from __future__ import annotations

import math

import numpy as np

from dcparallel.plan.context import MAX_MBS, PlanContext, RecomputeMode, mbs_candidates
from dcparallel.plan.dcp.classes import ClassPlan, allocate, deal_classes, distinct_plans, plan_sig
from dcparallel.plan.dcp.config import DEFAULT, DcpConfig
from dcparallel.plan.dcp.expand import StepSamples, build_plan, expand
from dcparallel.plan.dcp.search import expanded_floor, part_bound, plan_floor, rows, rows_at, rows_floor, search, table
from dcparallel.plan.dcp.tables import memo, planning_classes, sample_weights
from dcparallel.plan.steps import Step
from dcparallel.plan.types import REL_TOL
from dcparallel.spec import Layout


class ClassLevelPlanner:
    """The class-level plan of a step (`class_plan`) on the degrees `PlanContext.mix_sizes`
    (or, `chain_only`, the chain), over the context's buckets (or, `sub_bins` > 1, finer text
    length classes)."""

    name = "dcp"

    def __init__(self, ctx: PlanContext, *, mode: RecomputeMode = "pac", phases: bool = True, sub_bins: int = 1,
                 chain_only: bool = False, config: DcpConfig = DEFAULT):
        self.ctx, self.mode, self.phases = ctx, mode, phases
        #: the tunables (`config.DcpConfig`)
        self.config = config
        self.world = ctx.cluster.world_size
        self.tok = np.asarray(ctx.tokens, dtype=np.int64)
        #: planning classes: the context's buckets, or (text, `sub_bins` > 1) each bucket cut
        #: into `sub_bins` geometric length ranges, each sized by its own largest sample
        self.sub_bins = sub_bins if ctx.model.kind == "text" else 1
        self.rep, self.buckets, self.bidx = planning_classes(ctx, self.sub_bins)
        #: the SP degrees mixed (`PlanContext.mix_sizes`, or with `chain_only` its `sp_sizes`);
        #: where they are not one chain, group counts must pass `Topology.fits` (else: at most
        #: the world's ranks)
        self.sp = list(ctx.sp_sizes if chain_only else ctx.mix_sizes)
        self.packs = None if set(self.sp) <= set(ctx.topology.chain) else ctx.topology.fits
        self.top = {(j, k): ctx.max_mbs(self.rep[b], k, mode) for j, b in enumerate(self.buckets) for k in self.sp}
        self._rows: dict[tuple[int, int], np.ndarray] = {}
        #: `classes.allocate`'s caches: spans by (classes' id, groups), ids by the classes
        self._spans: dict[tuple, float] = {}
        self._deals: dict[tuple, list] = {}
        self._sigs: dict[tuple, int] = {}
        self._tiles: dict[tuple, list] = {}
        self._least_gpu: dict[tuple, list] = {}  # `search.expanded_floor`'s table per set of degrees
        #: per (bucket, degree): the time of a micro-batch of m copies of its largest sample, m = 0..top
        self.ttab = {(j, k): [0.0] + [self._lt(j, m, k)[1] for m in range(1, self.top[(j, k)] + 1)]
                     for j in range(len(self.buckets)) for k in self.sp}
        #: the same per degree as one array, [bucket, m] (inf where m copies do not fit)
        width = 1 + max(self.top.values(), default=0)
        self.ttab_arr = {k: np.array([self.ttab[(j, k)] + [np.inf] * (width - len(self.ttab[(j, k)]))
                                      for j in range(len(self.buckets))]).reshape(len(self.buckets), width)
                         for k in self.sp}
        self._ttab3 = np.stack([self.ttab_arr[k] for k in self.sp])  # [degree index, bucket, m]
        self._tops = np.array([[self.top[(j, k)] for j in range(len(self.buckets))] for k in self.sp])
        self._spa = np.asarray(self.sp)
        self._pow2 = np.array(mbs_candidates(MAX_MBS))
        self.weight = sample_weights(self)
        #: every sample in planning order (by class, then longest first, then id) and each
        #: sample's position in it: a step's samples are sorted by sorting their positions
        self._order = np.lexsort((np.arange(len(self.tok)), -self.tok, self.bidx))
        self._rank = np.empty(len(self.tok), dtype=np.int32 if len(self.tok) < 2 ** 31 else np.int64)
        self._rank[self._order] = np.arange(len(self.tok))

    def describe(self) -> dict:
        return {"recompute": self.mode, "phases": self.phases, "planner": "class-based (bucket, count)"}

    # -- layouts ---------------------------------------------------------------------------
    def _lt(self, j: int, m: int, k: int) -> tuple[Layout, float]:
        out = self.ctx.copies_layout(self.rep[self.buckets[j]], m, k, self.mode)
        assert out is not None, "the bucket's largest micro-batch fits, so smaller ones do"
        return out

    def deal(self, items: list[tuple[int, float, int]], n: int) -> list:
        """`deal_classes`, cached (the best few candidates of a step often share a degree's
        micro-batch classes); the group classes are read, never changed."""
        return memo(self._deals, (tuple(items), n), lambda: deal_classes(items, n))

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

    def _plan_part(self, tab: dict, part: list[int], found_by_k: list[list], keep: int = 1):
        """The best `keep` (predicted makespan, item classes, {degree: group classes}, step
        bound) for these buckets (positions in the step's table) in one phase, best first, from
        their search's candidates per smallest allowed degree (`search.search`; given for
        the first `config.first_degrees`, the rest searched here if the loop gets there); [] if none."""
        if not part:
            return []
        present = [tab["present"][i] for i in part]
        bnd = part_bound(tab, part, self.world)
        rows_of_part = np.asarray(part)
        found: list = []
        stale = 0
        done = tab.setdefault("allocated", {})  # the same choice found again (another smallest degree): same plan
        for ki in range(len(self.sp)):  # smallest allowed degree, narrowest first
            if found and self._settled(found, keep, self._floor(plan_floor(tab, rows_of_part, self.world, ki))):
                break  # no candidate here or at a wider smallest degree can enter the plans kept
            if ki == len(found_by_k):
                found_by_k = found_by_k + search(self, tab, [part], range(ki, len(self.sp)), tab["fracs"])[0]
            improved = False
            for c in found_by_k[ki]:
                key = (tuple(part), c.first.tobytes(), tuple(c.need.items()))
                got = done.get(key, False)
                if got is False:
                    if found and self._settled(found, keep, self._floor(rows_floor(tab, c.first, self.world))):
                        continue  # predicted at or above its floor, it cannot enter the plans kept
                    got = done[key] = allocate(self, present, rows_at(tab, c.first), c.need)
                if got is None:
                    continue
                if not found or got[0] < found[0][0] * (1 - REL_TOL):
                    improved = True
                found.append(got)
                found.sort(key=lambda g: g[0])
                del found[keep + 2:]
            if found and found[0][0] <= bnd * self.config.at_bound:
                break  # at the bound: wider minimums cannot help
            stale = 0 if improved or not found else stale + 1
            if stale >= self.config.stale_stop:  # wider minimums in a row did not help (a heuristic bound)
                break
        # groups are dealt only for plans that get expanded
        return distinct_plans([(span, items, counts_by_k, bnd) for span, items, counts_by_k in found], keep)

    def _ranked_out(self, cands: list[tuple], floor: float) -> bool:
        """Whether a candidate predicted at `floor` or above would never be expanded: above
        the best prediction x `config.expand_within`, or ranked below the `config.expand_best` best (ties: the
        earlier first)."""
        values = sorted(c[0] for c in cands)
        return floor > values[0] * self.config.expand_within or (
            len(values) >= self.config.expand_best and values[self.config.expand_best - 1] <= floor)

    def _floor(self, floor: float) -> float:
        """A floor the search skips work by, or -inf (nothing skipped) without `config.prune`."""
        return floor if self.config.prune else -math.inf

    @staticmethod
    def _settled(found: list, keep: int, bound: float) -> bool:
        """Whether no plan predicted at `bound` or above can change the `keep` best distinct
        plans of `found` (sorted): they are there, all below it."""
        sigs = set()
        for span, items, counts_by_k in found:
            if span >= bound * (1 - 1e-9):
                return False
            sigs.add(plan_sig(items, counts_by_k))
            if len(sigs) == keep:
                return True
        return False

    def _sort(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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

    def class_plan(self, step: Step) -> ClassPlan:
        """The class-level plan of the step (`ClassPlan`)."""
        ids = np.fromiter(step.sample_ids, dtype=np.int64, count=len(step.sample_ids))
        ids_sorted, b = self._sort(ids)  # by bucket, then longest first, then id
        n = len(ids_sorted)
        starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]]) if n else np.zeros(0, dtype=np.int64)
        present, counts = b[starts].tolist(), np.diff(np.r_[starts, n]).tolist()
        wsorted = self.weight[ids_sorted]
        # per class the running sum of its members' weights from 0, the runs concatenated
        cumw = np.zeros(n + len(present))
        cumw[np.arange(n) + np.repeat(np.arange(1, len(present) + 1), counts)] = wsorted
        base = np.arange(len(present)) + starts
        for x, c in zip(base.tolist(), counts):
            cumw[x:x + c + 1].cumsum(out=cumw[x:x + c + 1])
        ss = StepSamples(dict(zip(present, starts.tolist())), dict(zip(present, counts)), cumw,
                         dict(zip(present, base.tolist())))
        wsum = np.add.reduceat(wsorted, starts) if n else np.zeros(0)
        wmax = np.maximum.reduceat(wsorted, starts) if n else np.zeros(0)
        scale = {j: (float(x) / c, float(y)) for j, x, c, y in zip(present, wsum.tolist(), counts, wmax.tolist())}
        tab = table(self, present, counts, scale)
        whole = list(range(len(present)))
        first = range(min(self.config.first_degrees, len(self.sp)))
        tab["fracs"] = (1.0,)
        ones = self._plan_part(tab, whole, search(self, tab, [whole], first)[0], keep=self.config.expand_best)
        assert ones, "all buckets at the widest degree always fit the world"
        if ones[0][0] > ones[0][3] * self.config.cap_gate:  # above the bound: micro-batches capped lower too
            tab["fracs"] = self.config.cap_fractions
            more = self._plan_part(tab, whole, search(self, tab, [whole], first, self.config.cap_fractions)[0],
                                   keep=self.config.expand_best)
            ones = distinct_plans(sorted(ones + more, key=lambda c: c[0]), self.config.expand_best)
        one = ones[0]
        cands = [(c[0], [c]) for c in ones]
        if self.phases and one[0] > one[3] * self.config.two_phase_gate:  # one phase is not at the step's bound
            # split by the degree each bucket got in one phase, or by its cheapest degree
            widest: dict[int, int] = {}
            for it in one[1]:
                widest[it.bucket] = max(widest.get(it.bucket, 0), it.sp)
            keys = [{j: widest[j] for j in present}, {j: int(rows(self, j, c)[0, 1]) for j, c in zip(present, counts)}]
            # a split's candidate is predicted at or above its parts' floors: skip the split
            # where that already says it would not be expanded (`_ranked_out`; that only
            # tightens as candidates are added, so a split skipped now is skipped later too)
            splits, seen = [], set()
            for key in keys:
                for k in sorted(set(key.values()))[1:]:
                    wide = [i for i, j in enumerate(present) if key[j] >= k]
                    if tuple(wide) in seen:
                        continue
                    seen.add(tuple(wide))
                    narrow = [i for i, j in enumerate(present) if key[j] < k]
                    fw = self._floor(plan_floor(tab, wide, self.world))
                    fz = self._floor(plan_floor(tab, narrow, self.world))
                    if not self._ranked_out(cands, fw + fz):
                        splits.append((wide, narrow, fw, fz))
            found = search(self, tab, [part for split in splits for part in split[:2]], first, tab["fracs"])
            for s, (wide, narrow, fw, fz) in enumerate(splits):
                if self._ranked_out(cands, fw + fz):
                    continue
                a = self._plan_part(tab, wide, found[2 * s])
                if not a or self._ranked_out(cands, a[0][0] + fz):
                    continue
                z = self._plan_part(tab, narrow, found[2 * s + 1])
                if z:
                    cands.append((a[0][0] + z[0][0], [a[0], z[0]]))
        # the best few candidates by class-level prediction are expanded (least floor first, none
        # whose floor is above a prediction made) and the earliest within REL_TOL of the least kept
        cands.sort(key=lambda c: c[0])
        cfg = self.config
        pool = [parts for pre, parts in cands[: cfg.expand_best] if pre <= cands[0][0] * cfg.expand_within]
        floors = [self._floor(expanded_floor(self, parts, ss)) for parts in pool]
        got: dict[int, tuple] = {}
        least = math.inf  # the least prediction made
        for i in sorted(range(len(pool)), key=lambda i: (floors[i], i)):
            if floors[i] <= least * (1 + REL_TOL):
                got[i] = expand(self, pool[i], ss)
                least = min(least, got[i][1])
        best = got[min(i for i, g in got.items() if g[1] <= least * (1 + REL_TOL))]
        return ClassPlan(build_plan(self, step, best[0], int(self.tok[ids].sum()), ids_sorted), best[1], one[3],
                         max(tab["longest"]))

