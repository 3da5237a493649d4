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


def _plans():
    return {
        "bucket": {"sim_s": 20.0, "idle_fraction": 0.0, "settings": {"sp": 2}, "steps": 8},
        "dcp": {"sim_s": 10.0, "idle_fraction": 0.05, "settings": {"phases": True}, "steps": 8},
    }


def test_predict_scales_the_simulated_epoch_by_the_training_factor():
    """Predicted wall = simulated epoch x training factor + one optimizer step per step; at the
    profile's prices, unscaled; at the runs' speed when both reference times are known."""
    from dcparallel.apps.demo_predict import predict, prediction_errors

    real = {
        "plans": _plans(),
        "training_factor": 1.1,
        "optimizer_step_s": 0.05,
        "profile_reference_s": 0.004,
        "policies": {"bucket": {"wall_s": 22.0, "reference_s": 0.005}, "dcp": {"wall_s": 12.0, "reference_s": None}},
    }
    pred = predict(real)
    assert pred["bucket"]["wall_s"] == pytest.approx(20.0 * 1.1 + 8 * 0.05)
    assert pred["dcp"]["wall_s_profile"] == pytest.approx(10.0 + 8 * 0.05)
    assert pred["bucket"]["speed"] == pytest.approx(1.25)
    assert pred["bucket"]["wall_s_at_run_speed"] == pytest.approx((20.0 + 0.4) * 1.25)
    assert "speed" not in pred["dcp"]  # no reference ticked during its runs
    errors = prediction_errors(pred, real, "wall_s")
    assert errors["dcp"] == pytest.approx(abs(11.4 - 12.0) / 12.0)
    assert set(prediction_errors(pred, real, "wall_s_at_run_speed")) == {"bucket"}


def _run(wall, busy, hash_="h"):
    step = {"segs": [(0.0, busy, 1, False)], "priced": [1.0], "compute_end": busy, "end": busy, "sp": [1]}
    return {
        "wall_s": wall,
        "tokens_per_s": 1000 / wall,
        "steps": 1,
        "samples": 4,
        "samples_hash": hash_,
        "loss_first": 5.0,
        "loss_last": 4.0,
        "losses": [5.0],
        "rank_steps": [[step], [step]],
        "reference_s": None,
    }


def test_the_record_so_far_counts_the_median_run_and_pools_the_untimed_runs():
    """After each round the worker's record holds every policy's timed runs in order, the median
    one counted, and the training factor of the untimed runs (all policies pooled); before the
    untimed runs ran, no factor."""
    from dcparallel.apps.demo_worker import _real

    calibration = [{"bucket": _run(9.0, 1.2), "dcp": _run(5.0, 1.4)}]
    runs = {"bucket": [_run(20.0, 1.0), _run(24.0, 1.0), _run(21.0, 1.0)], "dcp": [_run(12.0, 1.0)] * 3}
    real = _real({"plans": _plans()}, calibration, runs)
    assert real["rounds_done"] == 3 and real["plans"] == _plans()
    assert real["training_factor"] == pytest.approx((1.2 + 1.4) / 2)
    assert real["policies"]["bucket"]["wall_s"] == 21.0 and real["policies"]["bucket"]["walls"] == [20.0, 24.0, 21.0]
    assert real["policies"]["dcp"]["walls"] == [12.0] * 3
    assert real["calibration"][0]["dcp"] == pytest.approx([1.4])
    first = _real({"plans": _plans()}, [], {n: rs[:1] for n, rs in runs.items()})
    assert first["rounds_done"] == 1 and first["training_factor"] is None and first["calibration"] == []


def test_each_round_prints_what_its_numbers_rest_on(capsys):
    """The comparison printed as runs come in: after round 1 labelled as one run each with the
    spread unknown; later, every run so far with the spread, the median counted."""
    import sys

    from dcparallel.apps.demo_predict import predict
    from dcparallel.apps.demo_report import print_round
    from dcparallel.apps.demo_worker import _real

    record = {"plans": _plans(), "optimizer_step_s": 0.0}
    real = _real(record, [], {"bucket": [_run(20.0, 1.0)], "dcp": [_run(12.0, 1.0)]})
    print_round(real, predict(real), 1, 3, sys.stdout)
    first = capsys.readouterr().out
    assert "round 1 of 3, first comparison: one timed run of each policy, so its spread is unknown" in first
    assert "predictions at the profile's prices (the untimed runs after this round measure" in first
    assert "spread" not in first.split("\n", 2)[2]  # no spread column on one run
    assert "dcp        12.0        10.0    17%     1.67x  12.0" in first  # 10.0 s simulated, unscaled
    cal = [{"bucket": _run(9.0, 1.2), "dcp": _run(5.0, 1.2)}]
    real = _real(record, cal, {"bucket": [_run(20.0, 1.0), _run(30.0, 1.0)], "dcp": [_run(12.0, 1.0)] * 2})
    print_round(real, predict(real), 2, 3, sys.stdout)
    second = capsys.readouterr().out
    assert "after 2 timed runs of each policy: the median run counts; predictions x 1.200" in second
    assert "bucket     20.0        24.0    20%" in second and "20.0, 30.0 (spread 40%)" in second  # median_low of 2
    assert "dcp        12.0        12.0     0%" in second


def test_the_plans_are_printed_with_the_profile_budget(capsys):
    import sys

    from dcparallel.apps.demo_report import print_plans

    record = {
        "profile_reused": False,
        "profile_s": 63.2,
        "profile_budget_s": 60.0,
        "profile_chains_coarse": 4,
        "profile_chains_skipped": 0,
        "memory_budget_bytes": 24 * 2**20,
        "budget_rule": "the rule",
        "tokens_per_step": 16384,
        "plans": _plans(),
    }
    print_plans(record, sys.stdout)
    text = capsys.readouterr().out
    assert "profiled in 63 s (budget 60 s; layout chains measured coarsely for it: 4, skipped: 0)" in text
    assert "24.0 MiB per rank (the rule)" in text and "the same 8 steps of 16,384 tokens" in text
    assert "dcp       10.0 s, ranks idle  5.0%, {'phases': True}" in text


def test_profile_budget_must_be_positive(tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).profile_budget > 0 and p.parse_args([]).repeats >= 2  # a spread by default
    args = p.parse_args(["--out", str(tmp_path), "--profile-budget", "0"])
    with pytest.raises(ValueError, match="--profile-budget must be a positive number of seconds, got 0"):
        run(args)
    assert not any(tmp_path.iterdir())


def test_phases_say_where_the_time_went():
    from dcparallel.apps.demo_report import cpu_text, phases_text

    phases = {"profile": 61.0, "plan": 4.0, "warm_up": 9.0, "rounds": [55.0, 54.0], "calibration": 56.0}
    text = phases_text({**phases, "launch": 250.0, "paper_scale": 21.0, "plots": 6.0})
    assert text == (
        "training launch 250 s: start-up and exit 11, profile 61, plans 4, warm-up 9, timed rounds 55 + 54, "
        "calibration 56; paper scale 21 s, plots 6 s"
    )
    text = cpu_text({**phases, "paper_scale": 40.0, "plots": 5.0})
    assert text == (
        "processor seconds: profile 61, plans 4, warm-up 9, timed rounds 55 + 54, calibration 56 (rank 0); "
        "paper scale 40, plots 5"
    )
