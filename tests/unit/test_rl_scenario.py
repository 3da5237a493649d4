"""The RL scenario (`sim.rl`) and RL frameworks' token-budget batching (`plan.research.token_budget`)."""

from __future__ import annotations

import numpy as np

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
from dcparallel.sim import rl
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import ClusterSpec, Workload, llama_like

SPEC = llama_like("tiny-llama", num_layers=3, hidden=32, num_heads=4, ffn_hidden=48, vocab_size=64)


def test_rollout_lengths_follow_the_scenario_bounds_in_generation_order():
    a = rl.rollout_lengths(4096, seed=1)
    assert a == rl.rollout_lengths(4096, seed=1) and a != rl.rollout_lengths(4096, seed=2)
    x = np.asarray(a)
    assert x.min() >= rl.PROMPT_MIN + 1 and x.max() <= rl.PROMPT_CAP + rl.RESPONSE_CAP
    assert 2500 < np.median(x) < 4000  # the response median plus a prompt
    assert 0.01 < (x > rl.RESPONSE_CAP).mean() < 0.03  # a tail cut at the cap (about 1.6%)
    steps = rl.rl_steps(1024, 4)
    assert [s.sample_ids[0] for s in steps] == [0, 1024, 2048, 3072]  # consecutive: as generated
    assert rl.generators(8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_token_budget_deals_equal_counts_and_runs_equal_micro_batch_counts():
    world = 4
    cluster = ClusterSpec(
        world_size=world,
        gpus_per_node=world,
        memory_bytes=1_200_000,
        intra_bw=300e9,
        inter_bw=300e9,
        intra_latency=1e-5,
    )
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in np.where(rng.random(37) < 0.15, rng.integers(480, 580, 37), rng.integers(8, 250, 37))]
    ctx = PlanContext(Workload(SPEC, tuple(lengths)), AnalyticCost(SPEC, cluster), cluster)
    step = Step(0, tuple(range(len(lengths))))
    planner = make_planner("token-budget", ctx, [step], score=step_seconds(ctx))
    plan = planner.plan(step)
    groups = [g for g in plan.groups if g.micro_batches]
    assert {g.sp for g in groups} == {planner.sp} == {2}  # the longest needs SP=2: every group takes it
    counts = [sum(len(mb.sample_ids) for mb in g.micro_batches) for g in groups]
    assert max(counts) - min(counts) <= 1 and sum(counts) == len(lengths)
    assert len({len(g.micro_batches) for g in groups}) == 1
    ids = sorted(i for g in groups for mb in g.micro_batches for i in mb.sample_ids)
    assert ids == list(range(len(lengths)))
    for g in groups:
        for mb in g.micro_batches:
            assert mb.layout.recompute.is_full(SPEC.num_layers)
            assert sum(lengths[i] for i in mb.sample_ids) <= planner.budget or len(mb.sample_ids) == 1
