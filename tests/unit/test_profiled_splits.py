"""A `ProfiledCost` over a profile that measured two splits per SP size (`Topology.profiled_splits`):
each micro-batch is priced at, and `best_split` names, the split measured fastest for it;
entries without a ring degree load as their size's measured split."""

from __future__ import annotations

import dataclasses

import pytest

from dcparallel.cost.base import mb_time
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import ClusterSpec, Layout, Workload
from dcparallel.topology import Topology
from tests.support import TWO_HEADS, two_head_profile

RING = ClusterSpec(world_size=4, gpus_per_node=4, memory_bytes=10**6, ring=True)

#: (sp, ring) -> seconds per token of one sample: at SP 2 ring (1u x 2r) is measured faster than
#: Ulysses (2u x 1r); at SP 4 the measured split 2u x 2r is faster than all-ring 1u x 4r
PER_TOKEN = {(1, 1): 4e-4, (2, 1): 3e-4, (2, 2): 2e-4, (4, 2): 1e-4, (4, 4): 1.5e-4}


def _profile(per_token=PER_TOKEN, ring_field=True) -> Profile:
    entries = []
    for key, tok in (("t500", 500), ("t4000", 4000)):
        for (sp, ring), s in per_token.items():
            for mbs in (1, 2):
                for mode, tf, mf in (("none", 1.0, 1.0), ("full", 1.3, 0.2)):
                    entries.append(
                        {
                            "bucket": key,
                            "sp": sp,
                            "mbs": mbs,
                            "recompute": mode,
                            "time_s": s * tok * mbs * tf,
                            "memory_bytes": 100.0 * tok / sp * mbs * mf,
                            **({"ring": ring} if ring_field else {}),
                        }
                    )
    return two_head_profile(entries)


def _split(cost, sizes, sp):
    s = cost.best_split(sizes, sp)
    return s.ulysses, s.ring


def test_the_profile_measures_the_two_extreme_splits_of_each_size():
    topo = Topology.of(RING, TWO_HEADS.num_heads)
    assert [topo.profiled_splits(k) for k in (1, 2, 4)] == [[(1, 1)], [(2, 1), (1, 2)], [(2, 2), (1, 4)]]
    off = Topology.of(dataclasses.replace(RING, ring=False), TWO_HEADS.num_heads)
    assert [off.profiled_splits(k) for k in (1, 2)] == [[(1, 1)], [(2, 1)]]


def test_best_split_follows_the_measurements_size_by_size():
    """Ring measured faster at SP 2, Ulysses 2 x ring 2 at SP 4: each micro-batch is priced at,
    and runs, the split measured fastest at its size, at every token count in between."""
    cost = ProfiledCost(_profile(), RING)
    for tok in (500, 2000, 4000):
        assert _split(cost, (tok,), 2) == (1, 2)
        assert _split(cost, (tok,), 4) == (2, 2)
        assert _split(cost, (tok, tok), 2) == (1, 2)
    assert mb_time(cost, [4000], Layout(2, 1)) == pytest.approx(2e-4 * 4000)  # ring's measured time
    assert mb_time(cost, [4000], Layout(4, 1)) == pytest.approx(1e-4 * 4000)
    sizes = (4000, 4000, 500, 500)
    ctx = PlanContext(Workload(TWO_HEADS, sizes), cost, RING)
    step = Step(0, tuple(range(len(sizes))))
    plan = make_planner("dcp", ctx, [step], score=step_seconds(ctx)).plan(step)
    for mb in plan.micro_batches():
        assert (mb.layout.ulysses, mb.layout.ring) == _split(cost, [sizes[i] for i in mb.sample_ids], mb.layout.sp)
    assert {(mb.layout.sp, mb.layout.ring) for mb in plan.micro_batches() if mb.layout.sp > 1} <= {(2, 2), (4, 2)}


def test_the_choice_flips_with_the_measurements():
    """The same profile with ring measured slower at SP 2 and all-ring faster at SP 4."""
    flipped = {**PER_TOKEN, (2, 2): 3.5e-4, (4, 4): 0.5e-4}
    cost = ProfiledCost(_profile(flipped), RING)
    assert _split(cost, (1000,), 2) == (2, 1)
    assert _split(cost, (1000,), 4) == (1, 4)
    assert mb_time(cost, [1000], Layout(4, 1)) == pytest.approx(0.5e-4 * 1000)


def test_entries_without_a_ring_degree_are_the_measured_split():
    """A profile written before entries carried their split (each size at its
    `Topology.measured_split`) prices and names that split; an entry's ring round-trips."""
    one = {k: v for k, v in PER_TOKEN.items() if k in ((1, 1), (2, 1), (4, 2))}
    old = ProfiledCost(_profile(one, ring_field=False), RING)
    assert _split(old, (4000,), 2) == (2, 1) and _split(old, (4000,), 4) == (2, 2)
    assert mb_time(old, [4000], Layout(4, 1)) == pytest.approx(1e-4 * 4000)
    prof = _profile()
    assert {(e.sp, e.ring) for e in prof.entries} == set(PER_TOKEN)
    d = prof.to_json()
    d["entries"][0] = {**d["entries"][0], "sp": 4, "ring": 3}
    with pytest.raises(ValueError, match="ring=3 at sp=4; the ring degree must divide"):
        Profile.from_json(d)


def test_a_cluster_without_ring_prices_only_the_ulysses_measurements():
    off = dataclasses.replace(RING, ring=False)
    cost = ProfiledCost(_profile({k: v for k, v in PER_TOKEN.items() if k[0] < 4}), off)
    assert _split(cost, (4000,), 2) == (2, 1)
    assert mb_time(cost, [4000], Layout(2, 1)) == pytest.approx(3e-4 * 4000)
