"""A profile saved as it goes (`profile.journal`): a profile killed part-way and started again
measures only the layout chains it had not finished, and ends with every chain; past its
wall-time budget a profile measures one micro-batch size and recompute none / full only.
A profile into a folder not made yet makes it. World 1, in-process (the chains of several
groups at world 2: the README snippet's run)."""

from __future__ import annotations

import json

import pytest

from dcparallel.cost.schema import ProfileBucket
from dcparallel.profile import ProfilerConfig, load_or_profile
from dcparallel.profile import budget as budget_mod
from tests.support import FakeClock, slow_measure
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
    monkeypatch.setattr(
        prof,
        "_measure",
        lambda size, ranks, mbs, mode, *rest: second.append((size, mode)) or real(size, ranks, mbs, mode, *rest),
    )
    profile, stats = load_or_profile(path, prof, [16, 32])
    assert not saved & set(second)  # nothing saved is measured again
    assert {(e.bucket, e.recompute) for e in profile.entries} == {(k, m) for k in key for m in MODES}
    assert path.exists() and not partial.exists()


def test_a_profile_past_its_budget_measures_only_what_a_cost_model_needs():
    prof = make_profiler(modes=MODES, max_mbs=4, budget_s=0.0, repeats=3, max_repeats=6)
    profile, stats = prof.run([16, 32])
    small = ProfileBucket.of(prof.spec, 16).key
    # recompute none and full once, coarsely (one sample, one timed round); nothing else
    assert {(e.bucket, e.mbs, e.recompute) for e in profile.entries} == {(small, 1, "none"), (small, 1, "full")}
    assert {e.rounds for e in profile.entries} == {1}
    assert (stats.chains_coarse, stats.chains_skipped) == (2, 4) and profile.unfit_buckets == []
    assert ProfilerConfig.quick().budget_s == 300.0  # the default profile's budget (docs/training.md)


@pytest.mark.parametrize("budget", [8.0, 14.0])
def test_a_profile_keeps_its_budget_and_reserves_it_for_the_large_buckets(budget, tmp_path, monkeypatch):
    """Measurements made slow on a fake clock (all chains measured fully take 2.5-4x the
    budget): the profile ends within its budget (no layout starts whose estimate would pass
    it), the small buckets are measured fully and the largest still coarsely (the reserve kept for it)."""
    clock, calls = FakeClock(), []
    monkeypatch.setattr(budget_mod, "_now", clock)
    prof = make_profiler(modes=MODES, max_mbs=4, budget_s=budget, repeats=3, max_repeats=3)
    monkeypatch.setattr(prof, "_measure", slow_measure(prof, clock, calls))
    sizes = [16, 32, 64, 128]
    profile, stats = load_or_profile(tmp_path / "p.json", prof, sizes)
    assert clock.t <= budget
    assert {(c[0], c[2]) for c in calls if c[3] == 1} >= {(128, "none"), (128, "full")}  # coarse, not skipped
    assert {(e.bucket, e.recompute) for e in profile.entries if e.feasible} >= {
        (ProfileBucket.of(prof.spec, s).key, m) for s in sizes for m in ("none", "full")
    }
    assert any(c[3] == 3 for c in calls) and stats.chains_coarse > 0  # the small buckets measured fully
    unbudgeted = FakeClock()
    monkeypatch.setattr(prof, "_measure", slow_measure(prof, unbudgeted, []))
    prof.config.budget_s = None
    prof.run(sizes)
    assert unbudgeted.t > 2.5 * budget  # what the budget saved


def test_no_layout_starts_that_would_pass_the_budget(monkeypatch):
    """A budget of 2 s on the fake clock, every micro-batch size measured (min_gain 0): the first
    chain's micro-batches 1 and 2 take 1.2 s, micro-batch 4 would take 1.6 s more (estimated
    from micro-batch 1: past the budget), so it is not started; of the later chains only those
    a cost model needs, and those estimated to fit, are measured."""
    clock, calls = FakeClock(), []
    monkeypatch.setattr(budget_mod, "_now", clock)
    prof = make_profiler(modes=MODES, max_mbs=4, budget_s=2.0, repeats=3, max_repeats=3, min_gain=0.0)
    monkeypatch.setattr(prof, "_measure", slow_measure(prof, clock, calls))
    profile, stats = prof.run([16, 32, 64, 128])
    assert clock.t <= 2.0
    assert [(size, mbs, mode) for size, mbs, mode, _ in calls[:2]] == [(16, 1, "none"), (16, 2, "none")]
    assert (16, 4, "none") not in {c[:3] for c in calls}
    assert {(e.recompute, e.rounds) for e in profile.entries if e.bucket == ProfileBucket.of(prof.spec, 16).key} >= {
        ("full", 1)  # measured coarsely although past its share: a cost model needs it
    }
    assert stats.chains_skipped > 0


def test_the_bar_states_the_budget_then_the_estimate_of_a_full_profile(monkeypatch, capsys):
    clock, calls = FakeClock(), []
    monkeypatch.setattr(budget_mod, "_now", clock)
    prof = make_profiler(modes=MODES, max_mbs=4, budget_s=8.0, repeats=3, max_repeats=3, progress=True)
    monkeypatch.setattr(prof, "_measure", slow_measure(prof, clock, calls))
    prof.run([16, 32, 64, 128])
    err = capsys.readouterr().err
    assert "profiling tiny, budget 8 s" in err
    # after the first chain (bucket 16, recompute none: mbs 1, 2, 4 at 0.4 s a sample): 2.8 s measured,
    # the rest estimated from it, all larger chains dearer than this one
    first = err.split("estimate ")[1].split(" s in full")[0]
    assert float(first) > 12 * 2.8


def test_a_profile_into_a_folder_not_made_yet_is_saved_there(tmp_path):
    """A fresh checkout has no `out/` or `runs/`: the README's `dcparallel profile` and the
    examples profile into such a folder; the chains saved as it goes make it."""
    path = tmp_path / "runs" / "examples" / "p.json"
    prof = make_profiler(modes=("none",))
    profile, _ = load_or_profile(path, prof, [16])
    assert path.exists() and profile.entries
    assert not (path.parent / "p.json.partial.rank0.json").exists()  # removed once the profile is saved
