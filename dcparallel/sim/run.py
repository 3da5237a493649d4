"""Plan an epoch with several policies and simulate each: the numbers `dcparallel simulate` prints."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Sequence

from dcparallel.cost.base import CostModel
from dcparallel.plan.bounds import LowerBound
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner, tune
from dcparallel.plan.steps import Step, form_steps
from dcparallel.plan.types import StepPlan
from dcparallel.sim.replay import SimResult, simulate, step_seconds
from dcparallel.spec import ClusterSpec, Workload


@dataclass
class PolicyRun:
    name: str
    plans: list[StepPlan]
    sim: SimResult
    setup_ms: float
    plan_ms_per_step: float
    settings: dict


def plan_epoch(ctx: PlanContext, steps: Sequence[Step], policy: str, progress: bool = False) -> PolicyRun:
    """Plans every step with ``policy`` (a tqdm bar on stderr with ``progress``) and simulates them."""
    t0 = time.perf_counter()
    tuned = tune(policy, ctx, steps, score=step_seconds(ctx))
    planner = tuned.planner
    t1 = time.perf_counter()
    plans = [planner.plan(s) for s in _bar(steps, f"planning {policy}", progress)]
    t2 = time.perf_counter()
    settings = dict(planner.describe())
    if tuned.tried:
        settings["tried_s"] = {k: round(v, 3) for k, v in tuned.tried.items()}
    return PolicyRun(policy, plans, simulate(plans, ctx), (t1 - t0) * 1e3,
                     (t2 - t1) * 1e3 / max(1, len(steps)), settings)


def _bar(steps: Sequence[Step], desc: str, progress: bool):
    """The steps, through a tqdm bar on stderr with ``progress``."""
    if not progress:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc=desc, unit="step", file=sys.stderr, leave=False)


def run_policies(workload: Workload, cost: CostModel, cluster: ClusterSpec, policies: Sequence[str], *,
                 tokens_per_step: int, seed: int = 0, epoch: int = 0, progress: bool = False,
                 max_steps: int | None = None) -> tuple[PlanContext, list[Step], dict[str, PolicyRun], float]:
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
            "setup_ms": round(r.setup_ms, 1),
            "peak_memory_fraction": round(s.peak_memory_fraction, 4),
            "peak_memory_bytes": round(s.peak_memory_fraction * s.memory_bytes),
            "memory_violations": s.memory_violations,
            "settings": r.settings,
        }
    return out


def scenario_timelines(scenario: str, distribution: str, world: int, gpus_per_node: int = 8,
                       policies: Sequence[str] = ("bucket", "dcp"), num_steps: int = 4,
                       seed: int | None = None) -> dict[str, dict[int, list]]:
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
