"""The profiler's robust timing with a fake timer: outlier rounds rejected (MAD), rounds
added until the median is stable (with a cap), the spread kept per entry in the profile
(schema version 2; version 1 still loads), the simulator's prediction range from the
spread, and the warning for a profile too noisy to trust."""

from __future__ import annotations

import argparse
import logging
import random

import pytest

from dcparallel.cost import schema
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.profile.robust import estimate, keep_mask, round_estimates, timed_until_stable
from dcparallel.spec import ClusterSpec
from tests.unit.test_profile import make_profiler

LAYER_S = 0.01  # the fake model: every layer takes 10 ms, the tiny Llama has 3


def test_a_stalled_round_is_rejected_and_the_median_kept():
    xs = [1.00, 1.01, 0.99, 1.02, 0.98, 5.0]  # one run stalled by another job
    assert keep_mask(xs) == [True] * 5 + [False]
    e = estimate(xs)
    assert e.value == 1.0 and e.rejected == 1 and e.kept == 5
    assert e.low < 1.0 < e.high and e.rel_half_width < 0.03
    assert estimate([2.0]).rel_half_width == 0.0  # one value: nothing to spread
    with pytest.raises(ValueError, match="at least one round"):
        estimate([])


def test_round_estimates_extrapolate_each_round_alone():
    # depths 1 and 2 of a 5-layer model: t_L = t2 + 3 (t2 - t1)
    assert round_estimates([1.0, 1.5], [2.0, 2.5], 1, 2, 5) == [5.0, 5.5]


def test_rounds_are_added_until_the_median_is_stable_and_capped():
    noisy = iter([1.0, 1.3, 0.8] + [1.0 + 0.001 * (i % 3) for i in range(100)])
    xs = timed_until_stable(lambda: next(noisy), min_rounds=3, max_rounds=30, rel_tol=0.03)
    assert 3 < len(xs) < 30  # more than the minimum, stopped once stable
    assert estimate(xs).rel_half_width <= 0.03
    rng = random.Random(0)
    xs = timed_until_stable(lambda: rng.uniform(0.5, 1.5), min_rounds=3, max_rounds=8, rel_tol=0.01)
    assert len(xs) == 8  # never stable: the cap
    one = iter([1.0, 1.0, 1.0, 9.0])
    assert len(timed_until_stable(lambda: next(one), min_rounds=1, max_rounds=9, rel_tol=0.03)) == 3  # 3 to judge
    calm = iter([1.0] * 10)
    # a rank that is done still runs the rounds its group needs
    assert (
        len(timed_until_stable(lambda: next(calm), min_rounds=2, max_rounds=5, rel_tol=0.03, agree=lambda done: False))
        == 5
    )
    with pytest.raises(ValueError, match="min_rounds <= max_rounds"):
        timed_until_stable(lambda: 1.0, min_rounds=4, max_rounds=3, rel_tol=0.1)


class FakeTimer:
    """Runs the layout (so the profiler's mechanics run for real) but reports the time of a
    model whose layers take `LAYER_S` each: rounds alternate the two depths (1 and 2 layers);
    `noise(i)` is the relative error of call i, `spike` the calls that stall."""

    def __init__(self, noise=lambda i: 0.0, spike=()):
        self.calls, self.noise, self.spike = 0, noise, set(spike)

    def time(self, fn) -> float:
        fn()
        i = self.calls
        self.calls += 1
        t = LAYER_S * (1 + i % 2) * (1 + self.noise(i))
        return t + (1.0 if i in self.spike else 0.0)


def profile_with(timer: FakeTimer, **cfg) -> Profile:
    prof = make_profiler(max_mbs=1, modes=("none",), **cfg)
    prof.timer = timer
    return prof.run([16])[0]


def test_profile_rejects_a_stall_and_keeps_the_spread_per_entry():
    rng = random.Random(1)
    # 1% noise and one stalled run (a one-layer run of round 3) in every layout
    p = profile_with(
        FakeTimer(noise=lambda i: rng.uniform(-0.01, 0.01), spike={6}), repeats=5, max_repeats=12, rel_tol=0.03
    )
    (e,) = [e for e in p.entries if e.feasible]
    assert e.time_s == pytest.approx(3 * LAYER_S, rel=0.03)  # without the rejection: off by > 100%
    assert e.rejected >= 1 and e.rounds >= 5
    assert 0 < e.time_spread < 0.03
    lo, hi = e.time_range()
    assert lo < e.time_s < hi
    assert p.noise_warning() is None
    again = Profile.from_json(p.to_json())  # the spread survives the JSON
    assert again.entries[0].time_spread == e.time_spread and again.to_json()["version"] == 2


def test_a_noisy_profile_is_said_to_be_untrustworthy(caplog):
    rng = random.Random(2)
    with caplog.at_level(logging.WARNING):
        p = profile_with(FakeTimer(noise=lambda i: rng.uniform(-0.6, 0.6)), repeats=3, max_repeats=6, rel_tol=0.03)
    (e,) = [e for e in p.entries if e.feasible]
    assert e.rounds == 6  # never stable: the cap
    assert e.time_spread > 0.1
    msg = p.noise_warning()
    assert msg is not None and "too noisy to trust" in msg and "quiet machine" in msg
    assert "too noisy to trust" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ProfiledCost(p, ClusterSpec(world_size=1, gpus_per_node=1))  # the profiler said it: once per process
    assert "too noisy to trust" not in caplog.text
    schema._NOISE_WARNED.clear()  # a later process, pricing from the saved profile, says so too
    with caplog.at_level(logging.WARNING):
        ProfiledCost(p, ClusterSpec(world_size=1, gpus_per_node=1))
    assert "too noisy to trust" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ProfiledCost(p, ClusterSpec(world_size=1, gpus_per_node=1))  # once per profile, not per cost object
    assert "too noisy to trust" not in caplog.text


def test_version_1_profiles_load_without_a_spread():
    rng = random.Random(3)
    p = profile_with(FakeTimer(noise=lambda i: rng.uniform(-0.01, 0.01)), repeats=3, max_repeats=3)
    d = p.to_json()
    d["version"] = 1
    for e in d["entries"]:
        for k in ("time_spread", "rounds", "rejected"):
            e.pop(k, None)
    old = Profile.from_json(d)
    assert old.spreads() is None and old.noise_warning() is None
    e = next(e for e in old.entries if e.feasible)
    assert e.time_range() == (e.time_s, e.time_s)


def test_simulate_reports_the_range_of_its_prediction(tmp_path):
    from dcparallel.apps.simulate import simulate_json

    rng = random.Random(4)
    prof = make_profiler(max_mbs=2, modes=("none",), repeats=3, max_repeats=4)
    prof.timer = FakeTimer(noise=lambda i: rng.uniform(-0.05, 0.05))
    p, _ = prof.run([16, 64])
    path = tmp_path / "p.json"
    p.save(path)
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(map(str, [16] * 20 + [64] * 6)) + "\n")
    ns = argparse.Namespace(
        scenario=None,
        distribution=None,
        lengths=lengths,
        world=1,
        gpus_per_node=1,
        seed=0,
        tokens_per_step=300,
        profile=path,
    )
    out = simulate_json(ns, ["packed", "dcp"], progress=False)
    for name, (lo, hi) in out["predicted_epoch_s_range"].items():
        mid = out["policies"][name]["epoch_time_s"]
        assert lo < mid < hi, (name, lo, mid, hi)
    assert out["profile_noise_warning"] is None
    from dcparallel.apps.simulate import _table

    assert "low / high end of its measured interval: packed" in _table(out)
