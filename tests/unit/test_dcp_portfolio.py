"""`dcp` by composition (`plan/dcp/portfolio.py`): a list of candidates with one interface,
candidate 0 the class level on the SP degrees mixed, gates reading facts the planner derives
(`candidate.StepFacts`, frozen), and the plan kept the fastest proposal by the portfolio's rule
(the class-level candidates by their predictions, the others by the score)."""

import dataclasses

import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.candidate import StepFacts
from dcparallel.plan.dcp.classlevel import ClassLevelPlanner
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.plan.types import REL_TOL
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import Workload, h200_cluster
from tests.unit.test_dcp_static import LLAMA_7M, code_files


@pytest.fixture(scope="module")
def small():
    """A 7M-parameter Llama on code files at 8 simulated GPUs: every kind of candidate runs,
    and the static `packed` plan wins some steps (`test_dcp_static`)."""
    cluster = h200_cluster(8, 8)
    ctx = PlanContext(Workload(LLAMA_7M, code_files(767)), AnalyticCost(LLAMA_7M, cluster), cluster)
    steps = form_steps(ctx.workload.tokens, seed=0, tokens_per_step=2**18)[:3]
    score = step_seconds(ctx)
    return ctx, steps, score, make_planner("dcp", ctx, steps, score=score)


def test_candidate_zero_is_the_class_level_on_the_degrees_mixed_and_all_share_one_interface(small):
    ctx, _, _, planner = small
    first = planner.candidates[0]
    assert isinstance(first, ClassLevelPlanner) and first.table.sp == list(ctx.mix_sizes)
    assert [c.name for c in planner.candidates] == ["class level", "per-sample", "packing", "bucket", "packed"]
    assert all(callable(c.runs) and callable(c.propose) for c in planner.candidates)


def test_the_plan_kept_is_the_fastest_proposal_and_the_facts_stay_as_derived(small):
    """Each step's plan is one of the proposals of the candidates whose gates opened, scored no
    slower than any of them (within REL_TOL); the facts a gate reads are frozen."""
    ctx, steps, score, planner = small
    kept_by = set()
    for s in steps:
        facts = StepFacts(s, len(s.sample_ids), ctx.cluster.world_size)
        for c in planner.class_level:
            if c.runs(facts):
                facts = facts.offered(c.name, c.propose(facts))
        with pytest.raises(dataclasses.FrozenInstanceError):
            facts.kept = None
        facts = dataclasses.replace(facts, score=lambda plan=facts.kept.plan: score(plan))
        proposals = {"class level": facts.kept.plan}
        for c in planner.scored:
            got = c.propose(facts) if c.runs(facts) else None
            if got is not None:
                proposals[c.name] = got.plan
        plan = planner.plan(s)
        names = [n for n, p in proposals.items() if p.to_json() == plan.to_json()]
        assert names, "the plan kept is a candidate's proposal"
        assert score(plan) <= min(score(p) for p in proposals.values()) * (1 + REL_TOL)
        kept_by.add(names[0])
    assert len(kept_by) > 1 or "packed" in kept_by, kept_by  # not only the class level's plans
