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
    real = {
        "policies": {
            "p": {
                "rank_steps": [
                    [step([(0.0, 1.0, 1, False)], 1.2)],
                    [step([(0.0, 0.4, 1, True)], 1.2)],
                ]
            }
        }
    }
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


def test_spread_of_repeats():
    from dcparallel.apps.demo_report import spread

    s = spread([88.5, 56.0, 60.0])
    assert (s["runs"], s["min"], s["median"], s["max"]) == (3, 56.0, 60.0, 88.5)
    assert s["relative"] == pytest.approx(32.5 / 60.0)


def test_the_median_run_counts():
    from dcparallel.apps.demo_report import counted
    from dcparallel.apps.demo_worker import counted_run

    runs = [{"wall_s": 26.8, "i": 0}, {"wall_s": 20.4, "i": 1}, {"wall_s": 24.0, "i": 2}]
    assert counted_run(runs)["i"] == 2 and counted([r["wall_s"] for r in runs]) == 24.0
    assert counted_run(runs[:2])["i"] == 1 and counted([26.8, 20.4]) == 20.4  # even: the faster middle one
    assert counted_run(runs[:1])["i"] == 0


def test_trust_notes_say_when_the_spread_swamps_the_difference():
    from dcparallel.apps.demo_report import trust_notes

    # the loaded machine of issue 14: bucket's runs 88.5 and 56.0 s, dcp 1.07x faster
    notes = trust_notes(
        {"bucket": [88.5, 56.0], "packed": [60.0, 61.0], "dcp": [52.3, 53.0]},
        {"bucket": 0.43, "packed": 0.05, "dcp": 0.05},
    )
    text = " ".join(notes)
    assert "dcp vs bucket" in text and "means nothing" in text and "56.0-88.5 s" in text
    assert "bucket's prediction error (43%) comes with a 45% spread of its own runs" in text
    assert "dcp's prediction error" not in text  # 5%: small, whatever the spread
    assert "--repeats 7" in notes[-1] and "idle machine" in notes[-1]
    # a clear difference with tight repeats: nothing to say
    assert (
        trust_notes(
            {"bucket": [80.0, 81.0], "packed": [70.0, 70.5], "dcp": [50.0, 50.4]},
            {"bucket": 0.05, "packed": 0.04, "dcp": 0.06},
        )
        == []
    )
    # one run each: the spread is unknown
    one = trust_notes({"bucket": [80.0], "packed": [70.0], "dcp": [50.0]})
    assert "ran once" in one[0] and "--repeats" in one[-1]


def test_speed_text_prices_the_prediction_at_the_runs_speed():
    from dcparallel.apps.demo_report import speed_text

    s = {
        "real": {"policies": {"bucket": {"wall_s": 50.0}, "dcp": {"wall_s": 30.0}}},
        "predicted": {
            "bucket": {"wall_s": 40.0, "speed": 1.25, "wall_s_at_run_speed": 50.0},
            "dcp": {"wall_s": 20.0, "speed": 1.35, "wall_s_at_run_speed": 27.0},
        },
        "prediction_error_at_run_speed": 0.1,
    }
    text = speed_text(s)
    assert "bucket 1.25x (50.0 s, 0%)" in text and "dcp 1.35x (27.0 s, 10%)" in text
    assert "(max over policies): 10%" in text


def test_training_factor_is_measured_busy_time_over_priced_time():
    """Summed over runs, ranks, steps (each run's first `skip` left out) and micro-batches: (end -
    start) of each micro-batch over its price; a calibration with no micro-batch is refused."""
    import pytest

    from dcparallel.apps.demo_worker import step_factors, training_factor

    first = {"segs": [(0.0, 5.0, 1, False)], "priced": [1.0]}  # a slow first step
    step = {"segs": [(0.0, 0.3, 1, False), (0.3, 0.9, 2, True)], "priced": [0.25, 0.5]}
    idle = {"segs": [], "priced": []}
    runs = [{"rank_steps": [[first, step, idle], [first, step, idle]]}, {"rank_steps": [[first, idle], [first, step]]}]
    assert training_factor(runs) == pytest.approx((4 * 5 + 3 * 0.9) / (4 + 3 * 0.75))
    assert training_factor(runs, skip=1) == pytest.approx(3 * 0.9 / (3 * 0.75))
    assert step_factors(runs[1]) == pytest.approx([5.0, 0.9 / 0.75])
    with pytest.raises(ValueError, match="no micro-batch"):
        training_factor([{"rank_steps": [[first, idle]]}], skip=1)
