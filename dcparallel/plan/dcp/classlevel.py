"""`dcp`'s class level (`ClassLevelPlanner`): a step planned over what is distinct in it —
(class, count) pairs and classes of alike groups — not over its samples.

Samples of one class are interchangeable for planning: a class's micro-batch is timed and
laid out (SP degree, micro-batch size, PAC recompute) for copies of the class's largest
sample, so it fits every sample of the class. Per step:

1. **Layouts by a makespan target.** For a target T, every class of the step takes the
   layout of least GPU-seconds whose micro-batch finishes within T (so a small T widens SP
   and shrinks micro-batches: the few-samples-per-GPU regime; a large T keeps the
   efficient narrow layouts); the groups each SP degree needs are estimated from its work
   and its micro-batches longer than T / 2. The smallest T whose groups fit the world is
   found among the distinct micro-batch times (`search`: a coarse pass, then the
   bracket it leaves), once per smallest allowed SP degree (forcing every class to at
   least that degree lets one phase hold a world-wide sample and the rest). Every target of
   the three narrowest smallest degrees (`DcpConfig.first_degrees`), and of every part of the
   two-phase splits, is evaluated in one batch of array operations per pass; a part whose
   search goes on to wider smallest degrees searches them in a batch of its own.
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
   floor first, one whose floor (`search.expanded_floor`) is above a prediction made is skipped,
   and one given up once its phases expanded and the later ones' floors are.

The SP degrees are `PlanContext.mix_sizes`: the topology's chain, and where the sizes inside a
node are not one chain (SP 3 and 6 beside 2 and 4 on 12-GPU nodes) those too; then a degree gets
another group only where `Topology.fits` places it, and the step is also planned on the chain
alone (a second `ClassLevelPlanner`, candidate `candidate.CHAIN`), the plan predicted faster kept.

Short names: p (the planner's `tables.LayoutTable`), tab (the step's `search.StepTable`),
j (a class: an index into the table's planning classes), c (a sample count, or a
`search.Candidate`), k (an SP degree), ki (a smallest allowed degree, as an index into
`p.sp`), ss (the step's samples, `expand.StepSamples`), g (an `Allocation`), bnd (a part's
bound), fw / fz (the floors of a split's wide and narrow parts), a / z (the best plans of
its wide and narrow parts), e (an `expand.Expansion`).
"""

from __future__ import annotations

import math

import numpy as np

from dcparallel.plan.dcp.allocate import allocate
from dcparallel.plan.dcp.classes import Allocation, ClassPlan, PartPlan, StepChoice, distinct_plans, plan_sig
from dcparallel.plan.dcp.expand import Expansion, StepSamples, build_plan, expand
from dcparallel.plan.dcp.search import (
    Row,
    StepTable,
    expanded_floor,
    expanded_floors,
    needs,
    part_bound,
    plan_floor,
    rows,
    rows_at,
    rows_floor,
    search,
    table,
)
from dcparallel.plan.dcp.tables import LayoutTable
from dcparallel.plan.steps import Step
from dcparallel.plan.types import REL_TOL


class ClassLevelPlanner:
    """The class-level plan of a step (`class_plan`) on a layout table (`tables.LayoutTable`:
    its planning classes and SP degrees), as a candidate of the `dcp` portfolio
    (`portfolio.Candidate`: it runs on every step; its prediction is its own)."""

    def __init__(self, table: LayoutTable, *, phases: bool = True, name: str = "class level"):
        #: the planning classes, degrees, layouts and caches the class level plans with
        self.table = table
        #: whether two-phase splits are searched
        self.phases = phases
        self.name = name
        self.config = table.config

    def describe(self) -> dict:
        return {"recompute": self.table.mode, "phases": self.phases, "planner": "class-based (planning class, count)"}

    def runs(self, facts) -> bool:
        return True  # on every step

    def propose(self, facts) -> ClassPlan:
        return self.class_plan(facts.step)

    def _plan_part(self, tab: StepTable, part: list[int], found_by_k: list[list], keep: int = 1):
        """The best `keep` `PartPlan`s for these classes (positions in the step's table) in one
        phase, best first, from their search's candidates per smallest allowed degree
        (`search.search`; given for the first `config.first_degrees`, the rest searched here if
        the loop gets there); [] if none."""
        if not part:
            return []
        present = [tab.present[i] for i in part]
        bnd = part_bound(tab, part, self.table.world)
        rows_of_part = np.asarray(part)
        found: list[Allocation] = []
        stale = 0
        done = tab.allocated  # the same choice found again (another smallest degree): same plan
        for ki in range(len(self.table.sp)):  # smallest allowed degree, narrowest first
            if found and self._settled(found, keep, self._floor(plan_floor(tab, rows_of_part, self.table.world, ki))):
                break  # no candidate here or at a wider smallest degree can enter the plans kept
            if ki == len(found_by_k):
                found_by_k = found_by_k + search(self.table, tab, [part], range(ki, len(self.table.sp)), tab.fracs)[0]
            improved = False
            for c in found_by_k[ki]:
                key = (tuple(part), c.first.tobytes(), c.need.tobytes())
                got = done.get(key, False)
                if got is False:
                    if found and self._settled(found, keep, self._floor(rows_floor(tab, c.first, self.table.world))):
                        continue  # predicted at or above its floor, it cannot enter the plans kept
                    got = done[key] = allocate(self.table, present, rows_at(tab, c.first), needs(self.table, c.need))
                if got is None:
                    continue
                if not found or got.span < found[0].span * (1 - REL_TOL):
                    improved = True
                found.append(got)
                found.sort(key=lambda g: g.span)
                del found[keep + 2 :]
            if found and found[0].span <= bnd * self.config.at_bound:
                break  # at the bound: wider minimums cannot help
            stale = 0 if improved or not found else stale + 1
            if stale >= self.config.stale_stop:  # wider minimums in a row did not help (a heuristic bound)
                break
        # groups are dealt only for plans that get expanded
        return distinct_plans([PartPlan(g.span, g.items, g.groups, bnd) for g in found], keep)

    def _ranked_out(self, cands: list[StepChoice], floor: float) -> bool:
        """Whether a candidate predicted at `floor` or above would never be expanded: above
        the best prediction x `config.expand_within`, or ranked below the `config.expand_best` best (ties: the
        earlier first)."""
        values = sorted(c.span for c in cands)
        return floor > values[0] * self.config.expand_within or (
            len(values) >= self.config.expand_best and values[self.config.expand_best - 1] <= floor
        )

    def _floor(self, floor: float) -> float:
        """A floor the search skips work by, or -inf (nothing skipped) without `config.prune`."""
        return floor if self.config.prune else -math.inf

    @staticmethod
    def _settled(found: list[Allocation], keep: int, bound: float) -> bool:
        """Whether no plan predicted at `bound` or above can change the `keep` best distinct
        plans of `found` (sorted): they are there, all below it."""
        sigs = set()
        for g in found:
            if g.span >= bound * (1 - 1e-9):
                return False
            sigs.add(plan_sig(g.items, g.groups))
            if len(sigs) == keep:
                return True
        return False

    def class_plan(self, step: Step) -> ClassPlan:
        """The class-level plan of the step (`ClassPlan`): the best few one-phase plans and,
        where the best is above the step's bound, two-phase splits; the best few expanded."""
        p = self.table
        ids = np.fromiter(step.sample_ids, dtype=np.int64, count=len(step.sample_ids))
        ids_sorted, b = p.sort(ids)  # by class, then longest first, then id
        present, counts, ss, scale = step_samples(p, ids_sorted, b)
        tab = table(p, present, counts, scale)
        first = range(min(self.config.first_degrees, len(p.sp)))
        ones = self._one_phase(tab, first)
        one = ones[0]
        cands = [StepChoice(c.span, [c]) for c in ones]
        if self.phases and one.span > one.bound * self.config.two_phase_gate:  # one phase is not at the step's bound
            self._two_phases(tab, counts, one, first, cands)
        best = self._expand_best(cands, ss)
        return ClassPlan(build_plan(p, step, best.phases, ids_sorted), best.predicted, one.bound, max(tab.longest))

    def _one_phase(self, tab: StepTable, first: range) -> list[PartPlan]:
        """The best `config.expand_best` one-phase plans of the step, searched uncapped and,
        above the bound, with micro-batches also capped (`config.cap_fractions`)."""
        p, cfg = self.table, self.config
        whole = list(range(len(tab.present)))
        tab.fracs = (1.0,)
        uncapped = search(p, tab, [whole], first)
        ones = self._plan_part(tab, whole, uncapped[0], keep=cfg.expand_best)
        assert ones, "all classes at the widest degree always fit the world"
        if ones[0].span > ones[0].bound * cfg.cap_gate:  # above the bound: micro-batches capped lower too
            tab.fracs = cfg.cap_fractions
            assert tab.fracs[0] == 1.0, "the capped search extends the uncapped one"
            capped = search(p, tab, [whole], first, tab.fracs[1:], known=uncapped)
            more = self._plan_part(tab, whole, capped[0], keep=cfg.expand_best)
            ones = distinct_plans(sorted(ones + more, key=lambda c: c.span), cfg.expand_best)
        return ones

    def _two_phases(
        self, tab: StepTable, counts: list[int], one: PartPlan, first: range, cands: list[StepChoice]
    ) -> None:
        """Adds to `cands` the two-phase plans of the step: the classes split by the degree each
        got in the best one-phase plan `one`, or by its cheapest degree; wide ones first."""
        p, present = self.table, tab.present
        widest: dict[int, int] = {}
        for it in one.items:
            widest[it.pclass] = max(widest.get(it.pclass, 0), it.sp)
        cheapest = {j: int(Row(*rows(p, j, c)[0]).k) for j, c in zip(present, counts)}  # least GPU-seconds
        splits = self._splits([{j: widest[j] for j in present}, cheapest], tab, cands)
        found = search(p, tab, [part for split in splits for part in split[:2]], first, tab.fracs)
        for s, (wide, narrow, fw, fz) in enumerate(splits):
            if self._ranked_out(cands, fw + fz):
                continue
            a = self._plan_part(tab, wide, found[2 * s])
            if not a or self._ranked_out(cands, a[0].span + fz):
                continue
            z = self._plan_part(tab, narrow, found[2 * s + 1])
            if z:
                cands.append(StepChoice(a[0].span + z[0].span, [a[0], z[0]]))

    def _splits(self, keys: list[dict[int, int]], tab: StepTable, cands: list[StepChoice]) -> list[tuple]:
        """The distinct two-phase splits (wide part, narrow part, their floors) of the classes
        by each degree of each `keys` (class -> degree) but the narrowest. A split's candidate
        is predicted at or above its parts' floors: a split is left out where that already
        says it would not be expanded (`_ranked_out`; that only tightens as candidates are
        added, so a split left out now would be skipped later too)."""
        p, present = self.table, tab.present
        splits, seen = [], set()
        for key in keys:
            for k in sorted(set(key.values()))[1:]:
                wide = [i for i, j in enumerate(present) if key[j] >= k]
                if tuple(wide) in seen:
                    continue
                seen.add(tuple(wide))
                narrow = [i for i, j in enumerate(present) if key[j] < k]
                fw = self._floor(plan_floor(tab, wide, p.world))
                fz = self._floor(plan_floor(tab, narrow, p.world))
                if not self._ranked_out(cands, fw + fz):
                    splits.append((wide, narrow, fw, fz))
        return splits

    def _expand_best(self, cands: list[StepChoice], ss: StepSamples) -> Expansion:
        """The best few candidates by class-level prediction expanded (least floor first, none
        whose floor is above a prediction made); the earliest within REL_TOL of the least."""
        p, cfg = self.table, self.config
        cands.sort(key=lambda c: c.span)
        pool = [c.parts for c in cands[: cfg.expand_best] if c.span <= cands[0].span * cfg.expand_within]
        phase_floors = [expanded_floors(p, parts, ss) for parts in pool]
        floors = [self._floor(expanded_floor(p, f)) for f in phase_floors]
        got: dict[int, Expansion] = {}
        least = math.inf  # the least prediction made
        for i in sorted(range(len(pool)), key=lambda i: (floors[i], i)):
            if floors[i] <= least * (1 + REL_TOL):
                # given up once it cannot end within REL_TOL of the least (then never kept)
                e = expand(p, pool[i], ss, least * (1 + REL_TOL) if cfg.prune else math.inf, phase_floors[i])
                if e is not None:
                    got[i] = e
                    least = min(least, e.predicted)
        return got[min(i for i, g in got.items() if g.predicted <= least * (1 + REL_TOL))]


def step_samples(p: LayoutTable, ids_sorted: np.ndarray, b: np.ndarray):
    """A step's classes in table order (`present`), their sample counts, its samples'
    positions and running weights (`StepSamples`), and per class its mean and largest weight
    in the step (the scale of its times: `search.table`)."""
    n = len(ids_sorted)
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]]) if n else np.zeros(0, dtype=np.int64)
    present, counts = b[starts].tolist(), np.diff(np.r_[starts, n]).tolist()
    wsorted = p.weight[ids_sorted]
    # per class the running sum of its members' weights from 0, the runs concatenated
    cumw = np.zeros(n + len(present))
    cumw[np.arange(n) + np.repeat(np.arange(1, len(present) + 1), counts)] = wsorted
    base = np.arange(len(present)) + starts
    for x, c in zip(base.tolist(), counts):
        cumw[x : x + c + 1].cumsum(out=cumw[x : x + c + 1])
    ss = StepSamples(
        dict(zip(present, starts.tolist())), dict(zip(present, counts)), cumw, dict(zip(present, base.tolist()))
    )
    wsum = np.add.reduceat(wsorted, starts) if n else np.zeros(0)
    wmax = np.maximum.reduceat(wsorted, starts) if n else np.zeros(0)
    scale = {j: (float(x) / c, float(y)) for j, x, c, y in zip(present, wsum.tolist(), counts, wmax.tolist())}
    return present, counts, ss, scale
