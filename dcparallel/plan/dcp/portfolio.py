"""`dcp`: our planner, built for thousands of GPUs, as a portfolio of candidate planners; the
plan predicted fastest is kept.

The candidates, in order, each with the gate that says when it runs:

1. the class level on the SP degrees mixed (`classlevel.ClassLevelPlanner`, which this
   planner is): every step;
2. the class level on the chain alone (`ChainAlone`), where the degrees mixed
   (`PlanContext.mix_sizes`) are not one chain: every step;
3. the class level over finer text classes (`FinerClasses`), above `config.v1_max_world`
   GPUs: steps of few samples per GPU whose class-level plan is above the bound
   (`few_samples_per_gpu_above_bound`);
4. the per-sample planner `dcp-v1` (`PerSampleV1`), up to `config.v1_max_world` GPUs: small
   steps (`small_step`);
5. the per-sample packing (`SamplePacking`): steps whose class-level plan is loose
   (`class_level_loose`);
6. the static layouts (`static.StaticLayout`): the `bucket` and `packed` baselines tuned on
   the epoch's steps as their policies tune, where the planner is given them: steps of at
   most `config.static_max_samples` samples.

The class-level candidates (1-3) are compared by their own predictions, the others (4-6) by
the score (the simulator's prediction) against the class-level plan kept; a candidate's plan
replaces the one kept only where it is predicted faster by more than `types.REL_TOL`, so ties
keep the earlier candidate's.

Everything is a deterministic function of the step and the context (no randomness, ties
broken by fixed orders), so every rank computes the same plan.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

from dcparallel.plan.context import PlanContext, RecomputeMode
from dcparallel.plan.dcp.classlevel import ClassLevelPlanner
from dcparallel.plan.dcp.config import DEFAULT, DcpConfig
from dcparallel.plan.dcp.sample import SamplePacker
from dcparallel.plan.dcp.static import StaticLayout
from dcparallel.plan.dcp.tables import Once, cyclic_gc_paused
from dcparallel.plan.steps import Step
from dcparallel.plan.types import REL_TOL, Score, StepPlan


class ScalePlanner(ClassLevelPlanner):
    """The `dcp` policy's planner: the class level on the degrees mixed (this class's own) and
    the other candidates of the portfolio (`class_level`: compared by prediction; `scored`:
    compared by the score). `sub_bins` > 1 or `chain_only` make a portfolio of the class level
    alone, with those classes or degrees; otherwise `static` (`static.static_layouts`) are
    offered too."""

    name = "dcp"

    def __init__(
        self,
        ctx: PlanContext,
        score: Score,
        *,
        mode: RecomputeMode = "pac",
        phases: bool = True,
        name: str = "dcp",
        sub_bins: int = 1,
        chain_only: bool = False,
        config: DcpConfig = DEFAULT,
        static: Sequence[StaticLayout] = (),
    ):
        super().__init__(ctx, mode=mode, phases=phases, sub_bins=sub_bins, chain_only=chain_only, config=config)
        self.name = name
        #: a plan's predicted step seconds (`plan.types.Score`): picks between the class-level
        #: plan and the per-sample ones
        self.score = score
        alone = self.sub_bins > 1 or chain_only  # the class level alone
        self.chain_alone = self.finer_classes = self.v1 = self.packer = None
        if not alone and self.packs is not None:
            self.chain_alone = ChainAlone(
                ClassLevelPlanner(ctx, mode=mode, phases=phases, chain_only=True, config=config)
            )
        if not alone and ctx.model.kind == "text" and self.world > config.v1_max_world:
            self.finer_classes = FinerClasses(
                partial(
                    ClassLevelPlanner, ctx, mode=mode, phases=phases, sub_bins=config.finer_sub_bins, config=config
                ),
                config,
            )
        if not alone and self.world <= config.v1_max_world:
            from dcparallel.plan.dcp_v1 import DCPPlanner

            self.v1 = PerSampleV1(
                DCPPlanner(ctx, name="dcp", mode=mode, balance=True, promote=True, phases=phases), config
            )
        if not alone:
            #: the per-sample packing, at every world size (it also beats `dcp-v1` on some
            #: small-cluster steps)
            self.packer = SamplePacker(ctx, mode, config)
        #: the candidates after this planner's own class level, in order: compared by their
        #: predictions, then by the score
        self.class_level = [c for c in (self.chain_alone, self.finer_classes) if c is not None]
        self.scored = [
            c for c in (self.v1, None if self.packer is None else SamplePacking(self.packer, config)) if c is not None
        ]
        self.static = [] if alone else list(static)
        self.scored += self.static
        #: steps planned, by the name of the scored candidate whose plan was kept ("class
        #: level" where none was)
        self.kept_by: Counter[str] = Counter()

    def describe(self) -> dict:
        out = super().describe()
        if self.static:
            out["static"] = {c.name: c.planner.describe() for c in self.static}
            out["kept_by"] = dict(sorted(self.kept_by.items()))
        return out

    def plan(self, step: Step) -> StepPlan:
        with cyclic_gc_paused():
            return self._plan_step(step)

    def _plan_step(self, step: Step) -> StepPlan:
        own = self.class_plan(step)
        s = Standing(step, len(step.sample_ids), self.world, own.plan, own.predicted, own.bound, own.longest)
        for c in self.class_level:
            if c.runs(s):
                c.offer(s)
        s.score = Once(partial(self.score, s.plan))  # the kept plan's score, taken when first asked
        others = [(c.name, c.plan(s)) for c in self.scored if c.runs(s)]
        others = [(name, p) for name, p in others if p is not None]
        plan, kept = s.plan, "class level"
        if others:
            best = s.score()
            for name, other in others:
                t = self.score(other)
                if t < best * (1 - REL_TOL):
                    plan, best, kept = other, t, name
        self.kept_by[kept] += 1
        return plan


@dataclass
class Standing:
    """What the portfolio's gates read about a step: its samples, the class-level plan kept so
    far with its prediction, the step's class-level bound and longest least micro-batch time
    (of the planner on the degrees mixed), and the chain's prediction over its own bound (0
    where the chain is not planned apart)."""

    step: Step
    n: int
    world: int
    plan: StepPlan
    predicted: float
    bound: float
    longest: float
    chain_at: float = 0.0
    #: the kept class-level plan's score, taken when first asked
    score: Once | None = None


class ChainAlone:
    """The class level on the chain alone, where the degrees mixed are not one chain: the
    heuristics do not always find the better plan in the larger space. Its prediction over its
    own bound also opens the later gates (as they would open on the chain alone)."""

    name = "chain"

    def __init__(self, planner: ClassLevelPlanner):
        self.planner = planner

    def runs(self, s: Standing) -> bool:
        return True  # on every step

    def offer(self, s: Standing) -> None:
        got = self.planner.class_plan(s.step)
        s.chain_at = got.predicted / got.bound
        if got.predicted < s.predicted * (1 - REL_TOL):
            s.plan, s.predicted = got.plan, got.predicted


class FinerClasses:
    """The class level over finer text classes (`config.finer_sub_bins` length ranges per
    bucket): a class laid out for its largest sample wastes less where a step has few samples
    per GPU. Its tables are built on the first step that opens its gate: a planner built for
    each step (`dc.plan_batch`) pays for them only on such steps."""

    name = "finer-classes"

    def __init__(self, make: Callable[[], ClassLevelPlanner], config: DcpConfig):
        self._planner, self.config = Once(make), config

    @property
    def planner(self) -> ClassLevelPlanner:
        return self._planner()

    def runs(self, s: Standing) -> bool:
        return self.few_samples_per_gpu_above_bound(s)

    def few_samples_per_gpu_above_bound(self, s: Standing) -> bool:
        c = self.config
        return (
            s.n <= c.finer_per_gpu * s.world
            and s.n <= c.finer_max_samples
            and (s.predicted > s.bound * c.finer_gate or s.chain_at > c.finer_gate)
        )

    def offer(self, s: Standing) -> None:
        got = self.planner.class_plan(s.step)
        if got.predicted < s.predicted * (1 - REL_TOL):
            s.plan, s.predicted = got.plan, got.predicted


class PerSampleV1:
    """The per-sample planner `dcp-v1` (plan/dcp_v1.py), cheap on small clusters and steps; it
    mixes SP degrees within a bucket, which the class level does not."""

    name = "dcp-v1"

    def __init__(self, planner, config: DcpConfig):
        self.planner, self.config = planner, config

    def runs(self, s: Standing) -> bool:
        return self.small_step(s)

    def small_step(self, s: Standing) -> bool:
        return s.n <= self.config.v1_max_samples

    def plan(self, s: Standing) -> StepPlan | None:
        return self.planner.plan(s.step)


class SamplePacking:
    """The per-sample packing (`sample.SamplePacker`): each sample (or, on larger steps, each
    micro-batch of its bucket's preferred size) timed alone at every degree; it runs where the
    class level is loose, and seeks only plans faster than the class-level plan's score."""

    name = "packing"

    def __init__(self, packer: SamplePacker, config: DcpConfig):
        self.packer, self.config = packer, config

    def gate(self, s: Standing) -> float:
        """How far above its bound the class-level plan must be: `pack_gate_one` with at most
        a sample per GPU or a heavy tail (the longest micro-batch takes much of the step: the
        packing's sub-groups gain most there), else `pack_gate`."""
        c = self.config
        return c.pack_gate_one if s.n <= s.world or s.longest >= s.bound * c.pack_tail else c.pack_gate

    def runs(self, s: Standing) -> bool:
        return self.class_level_loose(s)

    def class_level_loose(self, s: Standing) -> bool:
        """The class-level plan predicted (or, with about a sample per GPU or fewer, where the
        class level is least exact, scored) above its bound by the gate, or the chain's."""
        predicted, gate = s.predicted, self.gate(s)
        if s.n <= s.world and predicted > s.bound * self.config.at_bound:
            predicted = max(predicted, s.score())  # cheap on so few micro-batches
        return predicted > s.bound * gate or s.chain_at > gate

    def plan(self, s: Standing) -> StepPlan | None:
        c = self.config
        few = s.n <= min(c.pack_per_gpu * s.world, c.pack_max_samples)
        got = self.packer.plan(list(s.step.sample_ids), None if few else c.pack_max_items, s.score)
        return None if got is None else self.packer.step_plan(s.step, got.groups)
