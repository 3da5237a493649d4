"""A profile saved as it goes (`profile.journal`): a profile killed part-way and started again
measures only the layout chains it had not finished, and ends with every chain; past its
wall-time budget a profile measures one micro-batch size and recompute none / full only.
World 1, in-process (the chains of several groups at world 2: the README snippet's run)."""

from __future__ import annotations

import json

import pytest

from dcparallel.cost.schema import ProfileBucket
from dcparallel.profile import ProfilerConfig, load_or_profile
from tests.unit.test_profile import make_profiler

MODES = ("none", "attn", "full")


def test_a_killed_profile_resumes_from_the_chains_it_saved(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    prof = make_profiler(modes=MODES)
    key = {ProfileBucket.of(prof.spec, s).key: s for s in (16, 32)}
    real, first = prof._measure, []

    def killed_at_the_fifth(size, ranks, mbs, mode, *rest):
        first.append((size, mode))
        if len(first) == 5:
            raise KeyboardInterrupt  # as a kill would, at the start of the third chain
        return real(size, ranks, mbs, mode, *rest)

    monkeypatch.setattr(prof, "_measure", killed_at_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        load_or_profile(path, prof, [16, 32])
    partial = tmp_path / "p.json.partial.rank0.json"
    saved = {(key[b], m) for b, sp, m, _ in json.loads(partial.read_text())["chains"]}
    assert saved and not path.exists()

    second = []
    monkeypatch.setattr(prof, "_measure", lambda size, ranks, mbs, mode, *rest:
                        second.append((size, mode)) or real(size, ranks, mbs, mode, *rest))
    profile, stats = load_or_profile(path, prof, [16, 32])
    assert not saved & set(second)  # nothing saved is measured again
    assert {(e.bucket, e.recompute) for e in profile.entries} == {(k, m) for k in key for m in MODES}
    assert path.exists() and not partial.exists()


def test_past_its_budget_a_profile_is_coarse():
    prof = make_profiler(modes=MODES, max_mbs=4, budget_s=0.0, repeats=3, max_repeats=6)
    profile, _ = prof.run([16, 32])
    assert {(e.mbs, e.recompute) for e in profile.entries} == {(1, "none"), (1, "full")}
    assert {e.rounds for e in profile.entries} == {1}  # one timed round each, not the 3 asked for
    assert ProfilerConfig.quick().budget_s == 300.0  # the default profile's budget (docs/training.md)
