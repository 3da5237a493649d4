"""Load drift during a profile (`profile.drift`): the reference run timed in every round puts
every layout on one clock. A fake timer runs each layout for real but reports the time of a
model whose runs cost (layers run + 1) x tokens x 1 ms on a machine that gets twice as slow
when the 64-token bucket starts: without the reference the 64-token layout is priced 8x the
16-token one, with it 4x, as on a machine whose load had not changed."""

from __future__ import annotations

import json

import pytest

from dcparallel.cost.schema import Profile, ProfileEntry
from dcparallel.profile.drift import ReferenceClock, rescale
from tests.unit.test_profile import make_profiler


class DriftingTimer:
    """Reports (layers run + 1) x tokens x 1 ms x the machine's load: 1 until a run of 64 or
    more tokens is first seen, 2 from then on (the reference run included)."""

    def __init__(self, profiler):
        self.layers = profiler.layers
        self.tokens = 0
        self.load = 1.0
        profiler.model.register_forward_pre_hook(lambda m, args: setattr(self, "tokens", args[0].shape[-1]))

    def time(self, fn) -> float:
        fn()
        if self.tokens >= 64:
            self.load = 2.0
        ran = sum(not getattr(layer.forward, "skips_block", False) for layer in self.layers)  # `active_depth`
        return (ran + 1) * self.tokens * 1e-3 * self.load


def drifting_profile(reference: bool, rescale: bool = True) -> Profile:
    prof = make_profiler(max_mbs=1, modes=("none",), repeats=5, max_repeats=5, reference=reference, rescale=rescale)
    prof.timer = DriftingTimer(prof)
    return prof.run([16, 64])[0]


def test_the_reference_run_removes_load_drift_between_layouts():
    plain, fixed = drifting_profile(False), drifting_profile(True)
    tp, tf = ({e.bucket: e.time_s for e in p.entries} for p in (plain, fixed))
    assert tp["t64"] / tp["t16"] == pytest.approx(8.0)  # the drift, priced as cost
    assert tf["t64"] / tf["t16"] == pytest.approx(4.0)  # one clock
    assert plain.reference_s is None and "reference" not in plain.fingerprint["timing"]
    assert fixed.fingerprint["timing"]["reference"] is True  # a cached plain profile is not reused
    # the reference: one 16-token sample on one layer, (1 + 1) x 16 ms at load 1 and 2; the median
    # over the two layouts
    assert [e.measured["reference_s"] for e in fixed.entries] == [pytest.approx(0.032), pytest.approx(0.064)]
    assert fixed.reference_s == pytest.approx(0.048)
    scales = sorted(e.measured["load_scale"] for e in fixed.entries)
    assert scales[0] < scales[-1]  # the layout timed under load is scaled down against the other
    again = Profile.from_json(json.loads(json.dumps(fixed.to_json())))
    assert again.reference_s == fixed.reference_s
    assert [e.time_s for e in again.entries] == [e.time_s for e in fixed.entries]


def test_the_reference_run_recorded_without_rescaling():
    plain, kept = drifting_profile(False), drifting_profile(True, rescale=False)
    assert [e.time_s for e in kept.entries] == [pytest.approx(e.time_s) for e in plain.entries]  # as measured
    assert kept.entries[1].time_s / kept.entries[0].time_s == pytest.approx(8.0)
    assert [e.measured["reference_s"] for e in kept.entries] == [pytest.approx(0.032), pytest.approx(0.064)]
    assert kept.reference_s == pytest.approx(0.048)  # the machine's speed, kept for a run to compare against
    assert not any("load_scale" in e.measured for e in kept.entries)
    timing = kept.fingerprint["timing"]
    assert timing["reference"] is True and timing["rescale"] is False  # not reused as a rescaled profile
    assert "rescale" not in drifting_profile(True).fingerprint["timing"]


def test_rescale_and_the_clock_window():
    times = iter([1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0])
    clock = ReferenceClock(lambda: next(times))
    assert clock.since(0) is None
    for _ in range(5):
        clock.tick()
    mark = clock.mark()
    clock.tick()
    clock.tick()
    assert clock.since(mark) == 1.0  # two runs since the mark: widened to the last five (1, 1, 1, 3, 3)
    a = ProfileEntry(
        "t16", 1, 1, "none", time_s=2.0, measured={"reference_s": 1.0}, validation={"time_s": 2.2, "memory_bytes": 1.0}
    )
    b = ProfileEntry("t64", 1, 1, "none", time_s=9.0, measured={"reference_s": 3.0})
    c = ProfileEntry("t64", 1, 2, "none", time_s=6.0, measured={"reference_s": 2.0})
    off = ProfileEntry("t64", 1, 4, "none", feasible=False)
    assert rescale([a, b, c, off]) == 2.0  # the median reference
    assert (a.time_s, b.time_s, c.time_s) == (pytest.approx(4.0), pytest.approx(6.0), pytest.approx(6.0))
    assert a.validation["time_s"] == pytest.approx(4.4) and b.measured["load_scale"] == pytest.approx(2 / 3)
    assert rescale([off]) is None and off.time_s is None
