"""Plan an epoch with several policies and simulate each: the numbers `dcparallel simulate` prints.

Planning time is reported one way everywhere (`PlanTiming`, also by
`benchmarks/plan_cpu_time.py`): CPU time of this process (`time.process_time`, which other
jobs on a shared machine inflate far less than wall-clock time), split into the setup
(building and tuning the planner), the first step (which fills the planner's caches) and
the steady state (every later step: its median and maximum). `plan_ms_per_step` is the
steady-state median.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from dcparallel.cost.base import CostModel
from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner, tune
from dcparallel.plan.steps import Step, form_steps
from dcparallel.plan.types import StepPlan
from dcparallel.sim.replay import SimResult, simulate, step_seconds
from dcparallel.spec import ClusterSpec, Workload

#: what the planning times include, said wherever they are printed
PLAN_TIME_NOTE = (
    "plan ms: CPU time (process_time) per step, median over the steady state (every step after "
    "the first); the setup (building and tuning the planner) and the first step (filling its "
    "caches) are reported apart"
)


@dataclass(frozen=True)
class PlanTiming:
    """CPU milliseconds of planning an epoch: see the module docstring."""

    setup_ms: float
    first_step_ms: float
    #: every step after the first, in order (empty for a one-step epoch)
    steady_ms: tuple[float, ...]

    @property
    def steady_median_ms(self) -> float:
        """The steady state's median; the first step's time when there is no later step."""
        return statistics.median(self.steady_ms) if self.steady_ms else self.first_step_ms

    @property
    def steady_max_ms(self) -> float:
        return max(self.steady_ms) if self.steady_ms else self.first_step_ms


def timed_plans(
    plan: Callable[[Step], StepPlan],
    steps: Sequence[Step],
    setup_ms: float = 0.0,
    clock: Callable[[], float] = time.process_time,
) -> tuple[list[StepPlan], PlanTiming]:
    """Every step planned in order by ``plan``, each timed in CPU ms (`PlanTiming`)."""
    plans, ms = [], []
    for s in steps:
        c0 = clock()
        plans.append(plan(s))
        ms.append((clock() - c0) * 1e3)
    return plans, PlanTiming(setup_ms, ms[0] if ms else 0.0, tuple(ms[1:]))


@dataclass
class PolicyRun:
    name: str
    plans: list[StepPlan]
    sim: SimResult
    timing: PlanTiming
    settings: dict

    @property
    def setup_ms(self) -> float:
        return self.timing.setup_ms

    @property
    def plan_ms_per_step(self) -> float:
        """The steady-state median CPU ms per step (`PlanTiming`)."""
        return self.timing.steady_median_ms


def plan_epoch(ctx: PlanContext, steps: Sequence[Step], policy: str, progress: bool = False) -> PolicyRun:
    """Plans every step with ``policy`` (a tqdm bar on stderr with ``progress``) and simulates them."""
    c0 = time.process_time()
    tuned = tune(policy, ctx, steps, score=step_seconds(ctx))
    planner = tuned.planner
    setup_ms = (time.process_time() - c0) * 1e3
    plans, timing = timed_plans(planner.plan, _bar(steps, f"planning {policy}", progress), setup_ms)
    settings = dict(planner.describe())
    if tuned.tried:
        settings["tried_s"] = {k: round(v, 3) for k, v in tuned.tried.items()}
    return PolicyRun(policy, plans, simulate(plans, ctx), timing, settings)


def _bar(steps: Sequence[Step], desc: str, progress: bool):
    """The steps, through a tqdm bar on stderr with ``progress``."""
    if not progress:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc=desc, unit="step", file=sys.stderr, leave=False)


def run_policies(
    workload: Workload,
    cost: CostModel,
    cluster: ClusterSpec,
    policies: Sequence[str],
    *,
    tokens_per_step: int,
    seed: int = 0,
    epoch: int = 0,
    progress: bool = False,
    max_steps: int | None = None,
) -> tuple[PlanContext, list[Step], dict[str, PolicyRun], float]:
    """Plans and simulates one epoch per policy (its first ``max_steps`` steps, if given);
    returns the context, the (shared) steps, each policy's run and the epoch's lower bound."""
    ctx = PlanContext(workload, cost, cluster)
    steps = form_steps(workload.tokens, seed=seed, epoch=epoch, tokens_per_step=tokens_per_step)
    if max_steps is not None:
        steps = steps[:max_steps]
    runs = {}
    for name in policies:
        runs[name] = plan_epoch(ctx, steps, name, progress)
    # its LP bounds take up to seconds per step of few samples per GPU: a bar of its own
    bound = LowerBound(ctx).epoch(_bar(steps, "lower bound", progress))
    return ctx, steps, runs, bound


def summary(workload: Workload, runs: dict[str, PolicyRun], bound: float) -> dict:
    """The per-policy numbers of `simulate --json`."""
    out = {}
    for name, r in runs.items():
        planned = sorted(i for p in r.plans for mb in p.micro_batches() for i in mb.sample_ids)
        n = len({i for p in r.plans for i in p.sample_ids})  # the steps' samples (all, for a whole epoch)
        s = r.sim
        out[name] = {
            "samples_planned": len(planned),
            "samples_dropped": n - len(set(planned)),
            "samples_repeated": len(planned) - len(set(planned)),
            "steps": len(r.plans),
            "tokens_per_s": round(s.tokens_per_s, 1),
            "epoch_time_s": round(s.total_time, 4),
            "step_time_s_median": round(s.step_time_median, 4),
            "idle_fraction": round(s.idle_fraction, 4),
            "lower_bound_efficiency": round(bound / s.total_time, 4) if s.total_time else 0.0,
            "plan_ms_per_step": round(r.plan_ms_per_step, 3),
            "plan_ms_max": round(r.timing.steady_max_ms, 3),
            "plan_first_step_ms": round(r.timing.first_step_ms, 3),
            "setup_ms": round(r.setup_ms, 1),
            "peak_memory_fraction": round(s.peak_memory_fraction, 4),
            "peak_memory_bytes": round(s.peak_memory_fraction * s.memory_bytes),
            "memory_violations": s.memory_violations,
            "settings": r.settings,
        }
    return out


def scenario_timelines(
    scenario: str,
    distribution: str,
    world: int,
    gpus_per_node: int = 8,
    policies: Sequence[str] = ("bucket", "dcp"),
    num_steps: int = 4,
    seed: int | None = None,
) -> dict[str, dict[int, list]]:
    """Per-rank spans (`SimResult.rank_timeline`) of the first steps of a built-in scenario
    under each policy, simulated on its analytic cost model: what `report.plots.plot_timelines`
    draws."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.scenarios import DEFAULT_SEED, SCENARIOS, sample_sizes

    seed = DEFAULT_SEED if seed is None else seed
    sc = SCENARIOS[scenario]
    cluster = sc.cluster(world, gpus_per_node)
    workload = Workload(sc.model, tuple(sample_sizes(scenario, distribution, seed=seed)))
    ctx = PlanContext(workload, AnalyticCost(sc.model, cluster), cluster)
    steps = form_steps(workload.tokens, seed=seed, tokens_per_step=sc.tokens_per_step)
    out = {}
    for name in policies:
        planner = make_planner(name, ctx, steps, score=step_seconds(ctx))
        sim = simulate([planner.plan(s) for s in steps[:num_steps]], ctx)
        out[name] = {r: sim.rank_timeline(r) for r in range(world)}
    return out
