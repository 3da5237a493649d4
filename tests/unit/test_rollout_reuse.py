"""`RolloutPlanner` keeps the layouts it prices across steps: its plans must be exactly those
of a planner built from scratch on each step's lengths (golden comparison of whole plans)."""

from __future__ import annotations

import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.portfolio import FinerClasses
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
from dcparallel.runtime.rollout_step import RolloutPlanner
from dcparallel.scenarios import model_preset
from dcparallel.sim import rl
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import Workload, h200_cluster

MODEL = model_preset("llama-8b")


def _from_scratch(lengths: list[int], index: int, world: int, policy: str):
    """The step's plan by a new cost model, context and planner (nothing kept from other steps)."""
    cluster = h200_cluster(world, 8)
    ctx = PlanContext(Workload(MODEL, tuple(lengths)), AnalyticCost(MODEL, cluster), cluster)
    planner = make_planner(policy, ctx, [Step(index, tuple(range(len(lengths))))], score=step_seconds(ctx))
    plan = planner.plan(Step(index, tuple(range(len(lengths)))))
    finer = next((c for c in getattr(planner, "class_level", ()) if isinstance(c, FinerClasses)), None)
    return plan, finer is not None and finer._planner.value is not None


# (world, rollouts a step, policy): 64 GPUs runs the per-sample candidates of `dcp`; 1024
# GPUs with few rollouts a GPU opens the finer classes' gate on some steps
CASES = [(64, 160, "dcp"), (1024, 1200, "dcp"), (64, 160, "packed")]


@pytest.mark.parametrize(("world", "n", "policy"), CASES)
def test_plans_with_layouts_kept_equal_plans_from_scratch(world, n, policy):
    cluster = h200_cluster(world, 8)
    cost = AnalyticCost(MODEL, cluster)
    planner = RolloutPlanner(cost, cluster, policy, max_tokens=rl.RESPONSE_CAP + rl.PROMPT_CAP)
    lengths = rl.rollout_lengths(3 * n, seed=world)
    finer = []
    for k in range(3):  # step 0 prices layouts; steps 1 and 2 (fewer rollouts each) reuse them
        step = lengths[k * n : (k + 1) * n][: n - 7 * k]  # steps of different sizes too
        kept_before = set(planner._layouts)
        plan, _ = planner.plan_step(step, k)
        want, opened = _from_scratch(step, k, world, policy)
        finer.append(opened)
        assert plan == want and plan.to_json() == want.to_json(), f"step {k}"
        assert kept_before <= set(planner._layouts), "the layouts of earlier steps are kept"
    assert planner._layouts, "the planner prices layouts into the cache it keeps"
    if world == 1024 and policy == "dcp":
        assert any(finer), "some step opens the finer classes' gate (its planner built lazily)"


def test_layouts_kept_are_dropped_when_the_model_states_change():
    """Gradients held whole add bytes to every micro-batch (`CostModel.add_state_bytes`): the
    layouts priced before no longer hold, and the plan must be the one priced afresh."""
    world, n = 64, 160
    cluster = h200_cluster(world, 8)
    cost = AnalyticCost(MODEL, cluster)
    planner = RolloutPlanner(cost, cluster, "dcp")
    lengths = rl.rollout_lengths(n, seed=3)
    planner.plan_step(lengths, 0)
    extra = 60e9  # most of an H200: layouts that fit before must now recompute or widen
    cost.add_state_bytes(extra)
    plan, _ = planner.plan_step(lengths, 1)
    fresh_cost = AnalyticCost(MODEL, cluster)
    fresh_cost.add_state_bytes(extra)
    ctx = PlanContext(Workload(MODEL, tuple(lengths)), fresh_cost, cluster)
    want = make_planner("dcp", ctx, [Step(1, tuple(range(n)))], score=step_seconds(ctx)).plan(Step(1, tuple(range(n))))
    before, _ = _from_scratch(lengths, 1, world, "dcp")
    assert want != before, "the extra states change the plan (else this test shows nothing)"
    assert plan == want


def test_the_rl_benchmark_plans_from_scratch_as_plan_step_does():
    """`benchmarks/rl_steps.py`'s from-scratch planning (what `plan_batch` did before it kept
    layouts, the finer classes' tables built whether or not the step opens their gate) runs
    on the planner's interface and plans as `plan_step`: 256 rollouts on 8 GPUs."""
    from benchmarks.rl_steps import from_scratch

    cluster = h200_cluster(8, 8)
    lengths = rl.rollout_lengths(256, seed=8)
    planner = RolloutPlanner(AnalyticCost(MODEL, cluster), cluster, "dcp", max_tokens=rl.RESPONSE_CAP + rl.PROMPT_CAP)
    plan, _ = planner.plan_step(lengths, 0)
    again, ctx = from_scratch(lengths, 0, cluster)
    assert again == plan and len(ctx.sizes) == 256


def test_a_step_planners_class_tables_stop_at_each_class_samples():
    """A planner built for one RL step (`plan_step`) prices each class's copies only up to the
    class's samples in that step (a micro-batch holds no more), not up to
    `context.MAX_COPIES`: 256 rollouts on 8 GPUs."""
    from dcparallel.plan.dcp.tables import LayoutTable

    cluster = h200_cluster(8, 8)
    lengths = rl.rollout_lengths(256, seed=8)
    ctx = PlanContext(Workload(MODEL, tuple(lengths)), AnalyticCost(MODEL, cluster), cluster)
    table = LayoutTable(ctx)
    held = {j: int((table.bidx == j).sum()) for j in range(len(table.pclasses))}
    assert all(0 < top <= held[j] for (j, _), top in table.top.items() if top)
    assert any(ctx.most_copies(table.rep[table.pclasses[j]], k, "pac") > top for (j, k), top in table.top.items())
