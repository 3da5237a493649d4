"""Pieces of `dcparallel demo` that run without a launch: data, hashes, timelines."""

import argparse

import pytest

from dcparallel.apps.demo import add_arguments, run
from dcparallel.apps.demo_report import rank_timelines as _timelines
from dcparallel.apps.demo_worker import samples_hash
from dcparallel.data.synthetic import SyntheticText, builtin_lengths


def test_builtin_lengths_skewed_and_deterministic():
    a = builtin_lengths()
    assert a == builtin_lengths() and len(a) == 420
    assert min(a) >= 32 and max(a) <= 3072
    assert sum(x < 256 for x in a) > 0.6 * len(a) and sum(x >= 1024 for x in a) > 0


def test_synthetic_text_is_deterministic_and_sized():
    d = SyntheticText([5, 9], vocab=16)
    assert d[1].shape == (9,) and (d[1] == SyntheticText([5, 9], vocab=16)[1]).all()
    assert int(d[0].max()) < 16


def test_samples_hash_ignores_order_within_a_step_only():
    assert samples_hash([[1, 2], [3]]) == samples_hash([[2, 1], [3]])
    assert samples_hash([[1, 2], [3]]) != samples_hash([[3], [1, 2]])


def test_timelines_mark_idle_until_the_slowest_rank():
    step = lambda segs, end: {"segs": segs, "compute_end": segs[-1][1] if segs else 0.0, "end": end, "sp": [1]}
    real = {"policies": {"p": {"rank_steps": [
        [step([(0.0, 1.0, 1, False)], 1.2)],
        [step([(0.0, 0.4, 1, True)], 1.2)],
    ]}}}
    tl = _timelines(real, ("p",))["p"]
    assert tl[0] == [(0.0, 1.0, "busy sp=1"), (1.0, 1.2, "sync")]
    assert tl[1] == [(0.0, 0.4, "busy sp=1 recompute"), (0.4, 1.0, "idle"), (1.0, 1.2, "sync")]


def test_repeats_must_be_positive(tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path), "--repeats", "0"])
    with pytest.raises(ValueError, match="--repeats must be at least 1, got 0"):
        run(args)
    assert not any(tmp_path.iterdir())  # rejected before anything was written or launched
