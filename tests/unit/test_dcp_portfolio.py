"""`dcp` by composition (`plan/dcp/portfolio.py`): a list of candidates with one interface,
candidate 0 the class level on the SP degrees mixed, gates reading facts the planner derives
(`candidate.StepFacts`, frozen), and the plan kept the fastest proposal by the portfolio's rule
(the class-level candidates by their predictions, the others by the score)."""

import dataclasses
import gc

import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.candidate import StepFacts
from dcparallel.plan.dcp.classlevel import ClassLevelPlanner
from dcparallel.plan.dcp.portfolio import FinerClasses
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.plan.types import REL_TOL
from dcparallel.scenarios import SCENARIOS, sample_sizes
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import Workload, h200_cluster
from tests.unit._models import TINY_LM, cluster, cost
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


def _finer(planner):
    (finer,) = [c for c in planner.class_level if isinstance(c, FinerClasses)]
    return finer


def test_an_epochs_planner_builds_the_finer_tables_ahead_and_plans_as_one_built_lazily():
    """Tuned on an epoch whose short last step is small enough for the finer classes' gate,
    `dcp` builds their tables in its setup (`DcpPlanner.prepare`); a planner built lazily (on
    the first step that opens the gate) plans every step the same. A planner for one step
    builds nothing ahead."""
    cl = cluster(256, 8)
    sizes = tuple(16 + (i * 7919) % 40_000 for i in range(300))
    ctx = PlanContext(Workload(TINY_LM, sizes), cost(TINY_LM, cl), cl)
    steps = form_steps(ctx.workload.tokens, seed=0, tokens_per_step=sum(ctx.workload.tokens) * 2 // 5)  # 113, 126, 61
    assert len(steps[-1].sample_ids) < len(steps[0].sample_ids)  # a short last step
    assert _finer(make_planner("dcp", ctx, steps, score=step_seconds(ctx))).built  # `dcp` tuned on the epoch
    ahead = make_planner("dcp-own", ctx, steps, score=step_seconds(ctx))
    ahead.prepare(steps)
    assert _finer(ahead).built
    lazy = make_planner("dcp-own", ctx, steps, score=step_seconds(ctx))
    lazy.prepare(steps[:1])  # one step: nothing built ahead
    assert not _finer(lazy).built
    for s in steps:
        assert ahead.plan(s).to_json() == lazy.plan(s).to_json()
    assert _finer(lazy).built  # a step opened the gate: both planners ran the finer classes
    a, b = _finer(ahead).planner.table, _finer(lazy).planner.table
    assert (a.pclasses, a.rep, a.top, a.ttab) == (b.pclasses, b.rep, b.top, b.ttab)
    assert (a.bidx == b.bidx).all() and (a.weight == b.weight).all()


def test_an_epochs_planner_leaves_its_tables_out_of_the_young_generations():
    """`dcp` tuned on an epoch collects the cycle collector's young generations once built, so
    the first collection after it does not walk what the build made (its tables, the tuning's
    prices, with the collector paused) at the end of a step; a planner for one step, dropped
    after it, leaves them young. Counted as the objects in generations 0 and 1 right after the
    build (each on a fresh context), on the weak 256-GPU video/balanced cell."""
    sc = SCENARIOS["video"]
    tps = sc.tokens_per_step * 256 // 32
    w = Workload(sc.model, tuple(sample_sizes("video", "balanced", epoch_tokens=3 * tps)))
    cl = sc.cluster(256)
    steps = form_steps(w.tokens, seed=0, tokens_per_step=tps)

    def young_after(epoch):
        ctx = PlanContext(w, AnalyticCost(sc.model, cl), cl)
        gc.collect()
        planner = make_planner("dcp", ctx, epoch, score=step_seconds(ctx))
        young = len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
        del planner
        return young

    epoch, one = young_after(steps), young_after(steps[:1])
    assert len(steps) > 1 and epoch < 100 and one > 10_000, (epoch, one)
