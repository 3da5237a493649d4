"""The profile cache and the memory budget: a cached profile serves any budget at most as
large as the one it was measured under (its entries re-judged against the new budget, as
the profiler judges them); a larger budget profiles again."""

from __future__ import annotations

import json
import logging

from dcparallel.profile.cache import load_or_profile
from tests.unit.test_profile import make_profiler


def _no_profiling(*a, **k):
    raise AssertionError("profiled again although the cached profile serves this budget")


def test_a_smaller_budget_reuses_the_profile_and_a_larger_one_profiles(tmp_path, monkeypatch, caplog):
    path = tmp_path / "p.json"
    prof = make_profiler(modes=("none",), memory_limit=4e9)
    p1, stats = load_or_profile(path, prof, [16, 32])
    assert stats is not None and all(e.feasible for e in p1.entries)
    # the smallest budget the cheapest layout fits, so the larger layouts no longer do
    need = sorted(p1.model_state_bytes + e.memory_bytes for e in p1.entries)
    small = make_profiler(modes=("none",), memory_limit=need[0] + 1)
    monkeypatch.setattr(small, "run", _no_profiling)
    p2, stats2 = load_or_profile(path, small, [16, 32])
    assert stats2 is None and p2.fingerprint["memory_bytes"] == int(need[0] + 1)
    judged = {(e.bucket, e.mbs): (e.feasible, e.reason) for e in p2.entries}
    for e in p1.entries:  # the same measurements, judged against the new budget
        fits = p1.model_state_bytes + e.memory_bytes <= need[0] + 1
        assert judged[(e.bucket, e.mbs)] == (fits, None if fits else "over_budget")
    assert sum(f for f, _ in judged.values()) == 1
    assert json.loads(path.read_text())["fingerprint"]["memory_bytes"] == int(4e9)  # the file is kept
    larger = make_profiler(modes=("none",), memory_limit=8e9)
    with caplog.at_level(logging.WARNING):
        _, stats3 = load_or_profile(path, larger, [16, 32])
    assert stats3 is not None and "a larger budget than the cached profile's" in caplog.text
