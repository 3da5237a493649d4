"""The lower bound holds on measured profiles, however noisy: no policy's simulated epoch is
faster than the bound computed from the same cost model.

The profile is one recorded measurement of `test_profile.tiny_llama` (3 layers, 16-, 48- and
128-token buckets, micro-batches 1, 2, 4, each recompute mode; the times a loaded 2-core CPU
gave, memory the saved-tensor bytes), so that every run tests the same numbers: a profile
measured live differs run to run, and hypothesis, derandomized, then draws the same noise and
workloads every time. A failure reproduces.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile, ProfileBucket, ProfileEntry
from dcparallel.plan.context import PlanContext, mbs_candidates
from dcparallel.plan.policies import ALL
from dcparallel.sim.run import run_policies, summary
from dcparallel.spec import ClusterSpec, Workload
from tests.unit.test_profile import make_profiler

#: (bucket, recompute mode) -> [(micro-batch size, seconds, bytes)] as measured
RECORDED = {
    ("t16", "none"): [(1, 0.07094, 123412), (2, 0.02516, 259108), (4, 0.06247, 518212)],
    ("t16", "attn"): [(1, 0.07822, 73300), (2, 0.06288, 146596), (4, 0.09801, 293188)],
    ("t16", "mlp"): [(1, 0.1288, 74068), (2, 0.1001, 160420), (4, 0.3505, 320836)],
    ("t16", "full"): [(1, 0.5064, 17812), (2, 1.303, 35620)],
    ("t48", "none"): [(1, 0.9691, 370228), (2, 0.5622, 777316), (4, 0.2087, 1554628)],
    ("t48", "attn"): [(1, 0.7762, 219892), (2, 1.029, 439780), (4, 0.1156, 879556)],
    ("t48", "mlp"): [(1, 0.0838, 222196), (2, 0.1607, 481252)],
    ("t48", "full"): [(1, 0.03895, 53428), (2, 0.123, 106852)],
    ("t128", "none"): [(1, 0.2604, 987268), (2, 0.1082, 2072836), (4, 0.1083, 4145668)],
    ("t128", "attn"): [(1, 0.181, 586372), (2, 0.2936, 1172740), (4, 0.3174, 2345476)],
    ("t128", "mlp"): [(1, 0.2311, 592516), (2, 0.116, 1283332), (4, 0.106, 2566660)],
    ("t128", "full"): [(1, 0.1735, 142468), (2, 0.2921, 284932), (4, 0.168, 569860)],
}


@pytest.fixture(scope="module")
def recorded_profile() -> Profile:
    return recorded()


def recorded() -> Profile:
    """`RECORDED` as a profile of `test_profile.tiny_llama` at world 1."""
    spec = make_profiler().spec
    entries = [
        ProfileEntry(bucket, 1, mbs, mode, time_s=t, memory_bytes=float(mem), ranks=[0])
        for (bucket, mode), rows in RECORDED.items()
        for mbs, t, mem in rows
    ]
    buckets = [ProfileBucket(f"t{n}", n, n) for n in (16, 48, 128)]
    return Profile(
        fingerprint={},
        model=spec,
        world_size=1,
        gpus_per_node=1,
        model_state_bytes=spec.num_params * (4 + 4 + 8),
        grad_sync_s=0.0,
        buckets=buckets,
        entries=entries,
    )


def _assert_none_beats_the_bound(wl, cost, cluster, policies, tokens_per_step):
    _, _, runs, bound = run_policies(wl, cost, cluster, policies, tokens_per_step=tokens_per_step)
    for name, v in summary(wl, runs, bound).items():
        assert v["lower_bound_efficiency"] <= 1.0 + 1e-9, (name, v["lower_bound_efficiency"])


@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_policy_beats_the_lower_bound_on_a_noisy_profile(recorded_profile, data):
    """Each measurement scaled by 0.3..3x, any mix of lengths inside and beyond the profile's
    range, memory to spare."""
    p = recorded_profile
    d = p.to_json()
    for e in d["entries"]:
        e["time_s"] *= data.draw(st.floats(0.3, 3.0), label="noise")
    cluster = ClusterSpec(world_size=1, gpus_per_node=1, memory_bytes=p.model_state_bytes + 1e9)
    cost = ProfiledCost(Profile.from_json(d), cluster)
    sizes = data.draw(st.lists(st.sampled_from([8, 16, 30, 48, 90, 128, 200]), min_size=4, max_size=40), label="sizes")
    wl = Workload(p.model, tuple(sizes))
    _assert_none_beats_the_bound(wl, cost, cluster, ALL, data.draw(st.sampled_from([200, 400, 900]), label="budget"))


def _spread_over_sp(d: dict, world: int, draw) -> dict:
    """A world-1 profile's JSON as one measured at `world` ranks: every entry copied to each SP
    degree up to the world, its time scaled by 1 / k + 0.2 (communication) and by noise drawn
    in 0.3..3x, its memory split over the k ranks (+-20%)."""
    d = json.loads(json.dumps(d))
    d["world_size"] = d["fingerprint"]["world_size"] = world
    sps = [k for k in (1, 2, 4) if k <= world]
    entries = []
    for e in d["entries"]:
        for k in sps:
            x = dict(e, sp=k, ranks=list(range(k)))
            x["time_s"] = e["time_s"] * (1.0 / k + 0.2) * draw(st.floats(0.3, 3.0), label="noise")
            x["memory_bytes"] = e["memory_bytes"] / k * draw(st.floats(0.8, 1.2), label="memory noise")
            entries.append(x)
    d["entries"] = entries
    return d


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_policy_beats_the_lower_bound_on_a_noisy_profile_with_sp_and_tight_memory(recorded_profile, data):
    """The same at worlds 2 and 4, with SP degrees and memory budgets that force recomputation
    or SP; `packed`'s micro-batches mix lengths, which need less memory than copies of their
    longest sample (the bound prices what a sample adds to any mix: `plan.mix_share`)."""
    world = data.draw(st.sampled_from([2, 4]), label="world")
    d = _spread_over_sp(recorded_profile.to_json(), world, data.draw)
    memory = data.draw(st.sampled_from([4e5, 1e6, 1e9]), label="activation memory")
    cluster = ClusterSpec(world_size=world, gpus_per_node=world, memory_bytes=d["model_state_bytes"] + memory)
    profile = Profile.from_json(d)
    cost = ProfiledCost(profile, cluster)
    sizes = data.draw(st.lists(st.sampled_from([8, 16, 30, 48, 90, 128, 200]), min_size=4, max_size=60), label="sizes")
    wl = Workload(profile.model, tuple(sizes))
    budget = data.draw(st.sampled_from([300, 800, 2000]), label="tokens per step")
    _assert_none_beats_the_bound(wl, cost, cluster, ALL, budget)


def test_a_micro_batch_between_two_powers_of_two_cannot_beat_the_lower_bound(recorded_profile):
    """The bound's fewest GPU-seconds per sample are over every micro-batch size of copies, not
    only the powers of two the planners try. At world 2 with 400 kB for activations, copies of
    a 16-token sample cost least per sample at a size between two powers of two (the largest
    before the micro-batch must recompute: the next sample costs a jump); `bucket` stacks up
    to that many, and a bound taken at powers of two alone was above its simulated epoch."""
    d = _spread_over_sp(recorded_profile.to_json(), 2, lambda *_a, **_k: 1.0)  # no noise
    cluster = ClusterSpec(world_size=2, gpus_per_node=2, memory_bytes=d["model_state_bytes"] + 4e5)
    profile = Profile.from_json(d)
    cost = ProfiledCost(profile, cluster)
    wl = Workload(profile.model, (16,) * 5)
    ctx = PlanContext(wl, cost, cluster)
    top = ctx.max_mbs(16, 2, "pac")
    per_sample = {m: ctx.copies_layout(16, m, 2, "pac").time * 2 / m for m in range(1, top + 1)}
    least = min(per_sample, key=per_sample.get)
    assert per_sample[least] < min(per_sample[m] for m in mbs_candidates(top)), (least, per_sample)
    assert ctx.fewest_gpu_seconds(16, 2, top) == pytest.approx(per_sample[least], rel=1e-12)
    _assert_none_beats_the_bound(wl, cost, cluster, ALL, 2000)
