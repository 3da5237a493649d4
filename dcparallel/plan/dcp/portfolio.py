"""`dcp`: our planner, built for thousands of GPUs, as a portfolio of candidate planners; the
plan predicted fastest is kept (`DcpPlanner`).

Every candidate has one interface (`candidate.Candidate`): a `name`, a gate `runs(facts)` and
`propose(facts)`, which returns a `Proposal` (a plan and its predicted step seconds) or
None. `facts` (`candidate.StepFacts`) is what the gates read about the step; the planner
derives it, never a candidate. The candidates, in order, each with its gate:

0. the class level on the SP degrees mixed (`classlevel.ClassLevelPlanner`): every step. Its
   plan gives the step's class-level bound and longest least micro-batch time;
1. the class level on the chain alone (`candidate.CHAIN`), where the degrees mixed
   (`PlanContext.mix_sizes`) are not one chain: every step (the heuristics do not always
   find the better plan in the larger space). Its prediction over its own bound also opens
   the later gates, as they would open on the chain alone;
2. the class level over finer text classes (`FinerClasses`), above `config.per_sample_max_world`
   GPUs: steps of few samples per GPU whose class-level plan is above the bound;
3. the per-sample planner (`PerSample`), up to `config.per_sample_max_world` GPUs: small steps;
4. the per-sample packing (`SamplePacking`): steps whose class-level plan is loose (or, where
   a rank has room for one micro-batch only, the one-micro-batch-per-rank split); on steps of
   few samples per GPU whose classes each hold one size, its groups then split again in pairs
   (`resplit.Resplit`);
5. the static layouts (`static.StaticLayout`): the `bucket` and `packed` baselines tuned on
   the epoch's steps as their policies tune, where the planner is given them: steps of at
   most `config.static_max_samples` samples.

The class-level candidates (0-2, `DcpPlanner.class_level`) predict with the class level's own
model and are compared by it: the facts' kept plan is the fastest so far. The others (3-5,
`DcpPlanner.scored`) read the facts the class level leaves and propose plans priced by the
score (the simulator's prediction), compared with the score of the class-level plan kept. A
proposal replaces the plan kept only where it is predicted faster by more than
`types.REL_TOL`, so ties keep the earlier candidate's.

Everything is a deterministic function of the step and the context (no randomness, ties
broken by fixed orders), so every rank computes the same plan.

Short names: n (the step's samples), s (a `StepFacts`), c (a candidate, or the config).
"""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Callable, Sequence

from dcparallel.plan.context import PlanContext, RecomputeMode
from dcparallel.plan.dcp.candidate import CHAIN, Candidate, Once, Proposal, ScoredCandidate, StepFacts
from dcparallel.plan.dcp.classes import ClassPlan
from dcparallel.plan.dcp.classlevel import ClassLevelPlanner
from dcparallel.plan.dcp.config import DEFAULT, DcpConfig
from dcparallel.plan.dcp.per_sample import PerSamplePlanner
from dcparallel.plan.dcp.resplit import Resplit
from dcparallel.plan.dcp.sample import SamplePacker
from dcparallel.plan.dcp.static import StaticLayout
from dcparallel.plan.dcp.tables import LayoutTable
from dcparallel.plan.dcp.whole import WholeSplit
from dcparallel.plan.steps import Step
from dcparallel.plan.types import REL_TOL, Score, StepPlan


class DcpPlanner:
    """The `dcp` policy's planner: the class-level candidates (`class_level`, candidate 0 the
    class level on the degrees mixed), then the scored ones (`scored`; `static`:
    `static.static_layouts`, offered where given)."""

    name = "dcp"

    def __init__(
        self,
        ctx: PlanContext,
        score: Score,
        *,
        mode: RecomputeMode = "pac",
        phases: bool = True,
        name: str = "dcp",
        config: DcpConfig = DEFAULT,
        static: Sequence[StaticLayout] = (),
    ):
        self.name, self.config = name, config
        #: a plan's predicted step seconds (`plan.types.Score`): the scored candidates' measure
        self.score = score
        self.world = ctx.cluster.world_size
        own = ClassLevelPlanner(LayoutTable(ctx, mode=mode, config=config), phases=phases)
        #: the candidates compared by the class level's predictions, candidate 0 first
        self.class_level: list[Candidate] = [own]
        if own.table.packs is not None:  # the degrees mixed are not one chain
            chain = LayoutTable(ctx, mode=mode, chain_only=True, config=config)
            self.class_level.append(ClassLevelPlanner(chain, phases=phases, name=CHAIN))
        if ctx.model.kind == "text" and self.world > config.per_sample_max_world:
            finer = partial(LayoutTable, ctx, mode=mode, sub_bins=config.finer_sub_bins, config=config)
            self.class_level.append(FinerClasses(lambda: ClassLevelPlanner(finer(), phases=phases), config))
        #: the per-sample packing, at every world size (it also beats the per-sample planner
        #: on some small-cluster steps)
        self.packer = SamplePacker(ctx, mode, config)
        #: the candidates compared by the score, in order
        self.scored: list[ScoredCandidate] = []
        if self.world <= config.per_sample_max_world:
            per_sample = PerSamplePlanner(ctx, name="dcp", mode=mode, balance=True, promote=True, phases=phases)
            self.scored.append(PerSample(per_sample, score, config))
        self.scored.append(SamplePacking(self.packer, score, config))
        self.static = list(static)
        self.scored += self.static
        #: steps planned, by the name of the scored candidate whose plan was kept ("class
        #: level" where none was)
        self.kept_by: Counter[str] = Counter()

    @property
    def candidates(self) -> list[Candidate]:
        """Every candidate, in the order they run."""
        return [*self.class_level, *self.scored]

    def describe(self) -> dict:
        out = self.class_level[0].describe()
        if self.static:
            out["static"] = {c.name: c.planner.describe() for c in self.static}
            out["kept_by"] = dict(sorted(self.kept_by.items()))
        return out

    def prepare(self, steps: Sequence[Step]) -> None:
        """Builds ahead what the steps of an epoch (more than one step) will need, so the step
        that first needs it, most often the epoch's short last step, does not pay for it: the
        finer classes' tables where a step is small enough for their gate
        (`FinerClasses.small`), and the one-micro-batch-per-rank split's prices of the copies
        of each shape (`SamplePacking.prepare`). A planner made for one step (`dc.plan_batch`)
        builds them on the first step that needs them. Both are functions of the context (and
        the counts priced): plans are the same either way."""
        if len(steps) < 2:
            return
        for c in self.candidates:
            if isinstance(c, (FinerClasses, SamplePacking)):  # the candidates with something to build ahead
                c.prepare(steps, self.world)

    def plan(self, step: Step) -> StepPlan:
        with cyclic_gc_paused():
            return self._plan_step(step)

    def _plan_step(self, step: Step) -> StepPlan:
        s = StepFacts(step, len(step.sample_ids), self.world)
        for c in self.class_level:
            if c.runs(s):
                s = s.offered(c.name, c.propose(s))
        s = replace(s, score=Once(partial(self.score, s.kept.plan)))
        plan, best, kept = s.kept.plan, None, "class level"
        for c in self.scored:
            if not c.runs(s):
                continue
            floor = c.floor(s)
            if floor > 0.0 and floor >= (s.score() if best is None else best) * (1 - REL_TOL):
                continue  # its plan is no faster than its floor: it would not be kept
            got = c.propose(s)
            if got is None:
                continue
            if best is None:
                best = s.score()
            if got.predicted < best * (1 - REL_TOL):
                plan, best, kept = got.plan, got.predicted, c.name
        self.kept_by[kept] += 1
        return plan


class FinerClasses:
    """The class level over finer text classes (`config.finer_sub_bins` length ranges per
    bucket): a class laid out for its largest sample wastes less where a step has few samples
    per GPU. Its tables are built when the planner is tuned on an epoch with a step small
    enough for its gate (`DcpPlanner.prepare`), else on the first step that opens the gate: a
    planner built for each step (`dc.plan_batch`) pays for them only on such steps."""

    name = "finer-classes"

    def __init__(self, make: Callable[[], ClassLevelPlanner], config: DcpConfig):
        self._planner, self.config = Once(make), config

    @property
    def planner(self) -> ClassLevelPlanner:
        return self._planner()

    def prepare(self, steps: Sequence[Step], world: int) -> None:
        """Builds the tables and their planner now (once) where one of the steps is small
        enough for the gate."""
        if any(self.small(len(s.sample_ids), world) for s in steps):
            self._planner()

    @property
    def built(self) -> bool:
        return self._planner.value is not None

    def runs(self, s: StepFacts) -> bool:
        return self.few_samples_per_gpu_above_bound(s)

    def small(self, n: int, world: int) -> bool:
        """Whether a step of n samples is small enough for the gate: few samples per GPU."""
        c = self.config
        return n <= c.finer_per_gpu * world and n <= c.finer_max_samples

    def few_samples_per_gpu_above_bound(self, s: StepFacts) -> bool:
        c = self.config
        return self.small(s.n, s.world) and (s.predicted > s.bound * c.finer_gate or s.chain_at > c.finer_gate)

    def propose(self, s: StepFacts) -> ClassPlan:
        return self.planner.class_plan(s.step)


class PerSample:
    """The per-sample planner (`per_sample.PerSamplePlanner`), cheap on small clusters and
    steps; it mixes SP degrees within a class, which the class level does not."""

    name = "per-sample"

    def __init__(self, planner, score: Score, config: DcpConfig):
        self.planner, self.score, self.config = planner, score, config

    def runs(self, s: StepFacts) -> bool:
        return self.small_step(s)

    def floor(self, s: StepFacts) -> float:
        return 0.0

    def small_step(self, s: StepFacts) -> bool:
        return s.n <= self.config.per_sample_max_samples

    def propose(self, s: StepFacts) -> Proposal:
        plan = self.planner.plan(s.step)
        return Proposal(plan, self.score(plan))


class SamplePacking:
    """The per-sample packing (`sample.SamplePacker`): each sample (or, on larger steps, each
    micro-batch of its class's preferred size) timed alone at every degree; it runs where the
    class level is loose, and seeks only plans faster than the class-level plan's score. On
    steps of at most `config.whole_per_gpu` samples per GPU it first tries the
    one-micro-batch-per-rank split (`split`); on steps of at most `config.resplit_per_gpu` it
    splits the packed groups again in pairs (`resplit.Resplit`, where the classes each hold
    one size)."""

    name = "packing"

    def __init__(self, packer: SamplePacker, score: Score, config: DcpConfig):
        self.packer, self.score, self.config = packer, score, config
        #: the one-micro-batch-per-rank split, tried first on steps of few samples per GPU
        self.whole = WholeSplit(packer)

    def gate(self, s: StepFacts) -> float:
        """How far above its bound the class-level plan must be: `pack_gate_one` with at most
        a sample per GPU or a heavy tail (the longest micro-batch takes much of the step: the
        packing's sub-groups gain most there), else `pack_gate`."""
        c = self.config
        return c.pack_gate_one if s.n <= s.world or s.longest >= s.bound * c.pack_tail else c.pack_gate

    def runs(self, s: StepFacts) -> bool:
        return self.class_level_loose(s)

    def floor(self, s: StepFacts) -> float:
        return 0.0

    def class_level_loose(self, s: StepFacts) -> bool:
        """The class-level plan predicted (or, with about a sample per GPU or fewer, where the
        class level is least exact, scored) above its bound by the gate, or the chain's."""
        predicted, gate = s.predicted, self.gate(s)
        if s.n <= s.world and predicted > s.bound * self.config.at_bound:
            predicted = max(predicted, s.score())  # cheap on so few micro-batches
        return predicted > s.bound * gate or s.chain_at > gate

    def propose(self, s: StepFacts) -> Proposal | None:
        c = self.config
        if s.n <= c.whole_per_gpu * s.world:
            got = self.split(s)
            if got is not None:
                return got
        few = s.n <= min(c.pack_per_gpu * s.world, c.pack_max_samples)
        ids = list(s.step.sample_ids)
        got = self.packer.plan(ids, None if few else c.pack_max_items, s.score)
        if got is None:
            return None
        if s.n <= self.resplit_most(s.world):
            got = Resplit(self.whole, ids).improve(got, c.resplit_rounds)
        priced = getattr(self.score, "priced", None)  # a `PricedScore` of this context
        if priced is None or getattr(self.score, "ctx", None) is not self.packer.ctx:
            plan = self.packer.step_plan(s.step, got.groups)
            return Proposal(plan, self.score(plan))
        times: list[float] = []  # the micro-batches' times as the packing priced them, not priced again
        plan = self.packer.step_plan(s.step, got.groups, times)
        return Proposal(plan, priced(plan, times))

    def prepare(self, steps: Sequence[Step], world: int) -> None:
        """Prices ahead the copies the split and the re-split read on the steps of few enough
        samples per GPU to try them (`whole.WholeSplit.prepare`)."""
        few = max(self.config.whole_per_gpu * world, self.resplit_most(world))
        self.whole.prepare([list(s.sample_ids) for s in steps if len(s.sample_ids) <= few])

    def resplit_most(self, world: int) -> float:
        """The most samples of a step whose packing is split again in pairs (`resplit.Resplit`)."""
        c = self.config
        return min(c.resplit_per_gpu * world, c.pack_max_samples)

    def split(self, s: StepFacts) -> Proposal | None:
        """The one-micro-batch-per-rank split (`whole.WholeSplit`) where it plans the step
        faster than the class-level plan: the split plans only steps shorter than two of the
        shortest micro-batches, where a rank of any plan about as fast runs one micro-batch (the
        split's own space), so the packing is not run then (it costs more there)."""
        got = self.whole.plan(list(s.step.sample_ids))
        if got is None:
            return None
        plan = self.packer.step_plan(s.step, got.groups)
        predicted = self.score(plan)
        return Proposal(plan, predicted) if predicted < s.score() * (1 - REL_TOL) else None


@contextmanager
def cyclic_gc_paused():
    """Python's cycle collector paused while a step is planned. A plan at thousands of GPUs
    allocates a few hundred thousand small objects (micro-batches, their id tuples), which
    sets off collections that walk the whole heap — the workload, the model, the loader —
    which can take half of a step's planning time at 4096 GPUs. Planning makes no
    reference cycles (reference counting frees all it drops), so nothing piles up meanwhile;
    the collector resumes, in every thread, when the step is planned. The `dcp` planner is
    built paused too (`policies._dcp_portfolio`: its tables, the static layouts' tuning):
    otherwise a full collection lands in some builds and not others, up to 2.5x their CPU time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
