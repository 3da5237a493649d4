"""Every plan the loader hands out, and every rollout step's, holds each of its step's
samples exactly once: a planner whose plan leaves a sample out or plans one twice stops the
epoch with the samples named (`sim.plan_worker.checked_plan`, `RolloutPlanner.plan_step`,
`StepPlan.check_samples`), where the run would otherwise train on less, or more, than the
step. A `dcp` plan held as arrays (`expand.PhaseGroups`) is checked on its arrays
(`holds_once`); the objects are built only to name what is wrong."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.tight_bound import build_cell
from dcparallel.plan.dcp.expand import PhaseGroups
from dcparallel.plan.policies import make_planner
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.scenarios import SCENARIOS
from dcparallel.sim.replay import step_seconds

from .test_loader import local, text_data


class Tampering:
    """A real planner whose plans lose the last sample of their first micro-batch of two or
    more (``repeat``: hold the step's first sample a second time instead)."""

    def __init__(self, planner, repeat: bool = False):
        self.inner, self.name, self.repeat = planner, planner.name, repeat

    def plan(self, step):
        plan = self.inner.plan(step)
        groups, done = [], False
        for g in plan.groups:
            mbs = []
            for m in g.micro_batches:
                if not done and len(m.sample_ids) >= 2:
                    ids = m.sample_ids + (plan.sample_ids[0],) if self.repeat else m.sample_ids[:-1]
                    m, done = MicroBatch(ids, dataclasses.replace(m.layout, mbs=len(ids))), True
                mbs.append(m)
            groups.append(GroupPlan(g.ranks, tuple(mbs), g.phase))
        assert done, "the test needs a micro-batch of two samples or more"
        return StepPlan(plan.index, plan.sample_ids, tuple(groups), plan.num_tokens)

    def describe(self) -> dict:
        return self.inner.describe()


@pytest.mark.parametrize("repeat,why", [(False, r"1 left out \[\d+\]"), (True, r"1 planned more than once \[\d+\]")])
def test_the_loader_refuses_a_plan_that_loses_or_repeats_a_sample(repeat, why):
    ds, lens = text_data(24, lo=16, hi=600)
    loader = local(ds, lens, world=2)
    assert len(next(iter(loader)).sample_ids) > 0  # the untouched planner's plans pass
    build = loader.planner
    loader.planner = lambda epoch: Tampering(build(epoch), repeat)
    with pytest.raises((ValueError, RuntimeError), match=why):
        for _ in loader:
            pass


def test_a_dcp_plan_held_as_arrays_is_checked_on_them():
    """On real `dcp` plans of a video mix at 64 GPUs (the class level's plans, held as
    `PhaseGroups`): the array check passes each, and fails, with the samples named by
    `check_samples`, where one micro-batch holds one sample fewer or one more."""
    sc = SCENARIOS["video"]
    ctx, steps = build_cell("video", "video-mix", 64, sc.tokens_per_step * 2, 2)
    planner = make_planner("dcp", ctx, steps[:2], score=step_seconds(ctx))
    arrays = 0
    for step in steps[:2]:
        plan = planner.plan(step)
        src = plan._source
        if not isinstance(src, PhaseGroups):
            continue
        arrays += 1
        assert src.holds_once(plan.sample_ids)
        plan.check_samples()
        ph = src.phases[0]
        a = int((ph.m >= 2).argmax())  # a micro-batch of two samples or more
        assert ph.m[a] >= 2 and ph.start[a] + ph.m[a] < len(src.ids)
        for delta, why in ((-1, r"1 left out"), (1, r"1 planned more than once")):
            m = ph.m.copy()
            m[a] += delta
            bad = PhaseGroups(src.world, src.ids, (ph._replace(m=m), *src.phases[1:]))
            assert not bad.holds_once(plan.sample_ids)
            with pytest.raises(ValueError, match=why):
                StepPlan(plan.index, plan.sample_ids, bad, plan.num_tokens).check_samples()
        assert not src.holds_once(plan.sample_ids[1:] + (max(plan.sample_ids) + 1,))  # other samples
    assert arrays, "no plan of these steps was held as arrays"


def test_a_rollout_step_that_loses_a_rollout_is_refused(monkeypatch):
    """The ranks' rollouts are planned as one step (`RolloutPlanner.plan_step`): with the real
    policies each rollout is planned once; a planner that loses one stops the step, naming it."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.runtime import rollout_step
    from dcparallel.runtime.rollout_step import RolloutPlanner
    from dcparallel.spec import ClusterSpec, llama_like

    spec = llama_like("tiny-llama", num_layers=3, hidden=32, num_heads=4, ffn_hidden=48, vocab_size=64)
    cl = ClusterSpec(world_size=4, gpus_per_node=4, memory_bytes=1_200_000, intra_bw=300e9, inter_bw=300e9)
    lengths = [40, 41, 300, 12, 90, 7, 64, 64]
    for policy in ("dcp", "bucket", "packed"):
        plan, _ = RolloutPlanner(AnalyticCost(spec, cl), cl, policy).plan_step(lengths, 0)
        assert sorted(i for m in plan.micro_batches() for i in m.sample_ids) == list(range(len(lengths)))
    make = rollout_step.make_planner
    monkeypatch.setattr(rollout_step, "make_planner", lambda *a, **k: Tampering(make(*a, **k)))
    with pytest.raises(ValueError, match=r"1 left out \[\d\]"):
        RolloutPlanner(AnalyticCost(spec, cl), cl, "packed").plan_step(lengths, 0)
