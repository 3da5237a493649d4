"""`dcparallel simulate` says what its GPU numbers rest on (`cost.provenance`): the packaged
calibration files of the analytic model, their GPU, torch and date (none recorded), the links
being analytic; or the profile's device, torch and file date."""

from __future__ import annotations

import argparse
import datetime

import pytest

from dcparallel.apps.simulate import _table, simulate_json
from dcparallel.cost import calibration_fit
from dcparallel.cost.provenance import CALIBRATION_FILES, NOT_DATED
from tests.unit.test_profile import make_profiler


def _args(tmp_path, sizes: list[str], **kw) -> argparse.Namespace:
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(sizes) + "\n")
    base = {
        "scenario": None,
        "distribution": None,
        "lengths": lengths,
        "world": 8,
        "gpus_per_node": 8,
        "seed": 0,
        "tokens_per_step": None,
        "profile": None,
    }
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    "kind,sizes,cal", [("text", ["512"] * 30 + ["8192"] * 4, "llama-7b"), ("video", ["16 256 256"] * 12, "stdit-1.1b")]
)
def test_analytic_numbers_name_their_calibration_files_gpu_and_missing_date(tmp_path, kind, sizes, cal):
    out = simulate_json(_args(tmp_path, sizes, tokens_per_step=2**17), ["packed"], progress=False)
    src = out["calibration"]
    assert src["cost"] == "analytic" and src["calibration"] == cal
    assert src["files"] == [f"dcparallel/calibration/{f}" for f in CALIBRATION_FILES[cal]]
    assert src["gpu"].startswith("NVIDIA H200") and src["torch"] == "2.11.0+cu130"
    assert src["date"] == NOT_DATED and src["links"].startswith("analytic, no measurement")
    line = _table(out).splitlines()[-2]
    assert line.startswith("GPU numbers: analytic cost, calibration " + cal)
    assert CALIBRATION_FILES[cal][0] in line and "NVIDIA H200" in line and NOT_DATED in line


@pytest.mark.parametrize("cal", sorted(CALIBRATION_FILES))
def test_the_files_named_are_the_files_the_fit_reads(monkeypatch, cal):
    read = []
    load = calibration_fit._load
    monkeypatch.setattr(calibration_fit, "_load", lambda name: read.append(name) or load(name))
    calibration_fit.fit_calibration.__wrapped__(cal)
    assert sorted(set(read)) == sorted(CALIBRATION_FILES[cal])


def test_profiled_numbers_name_the_profile_its_device_and_date(tmp_path):
    profile, _ = make_profiler(max_mbs=2, modes=("none",), repeats=2, max_repeats=2).run([16, 64])
    path = tmp_path / "p.json"
    profile.save(path)
    args = _args(tmp_path, ["16"] * 20 + ["64"] * 6, world=1, gpus_per_node=1, tokens_per_step=300, profile=path)
    src = simulate_json(args, ["packed"], progress=False)["calibration"]
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert src["cost"] == "profiled" and src["files"] == [str(path)]
    assert src["gpu"] == profile.fingerprint["device"] and src["torch"] == profile.fingerprint["torch"]
    assert src["date"] == f"{today} (file written)" and src["links"] == "measured in the profile"
