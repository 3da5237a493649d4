"""`dcparallel demo` end to end on a small lengths file: the profile and the plans come first,
then a comparison after every round (the first labelled as one run each, before the untimed
calibration runs), then the report; every policy trains the same samples in the same steps,
each run counted and reported.

Slow (minutes: a profile and 3 x 3 training runs under torchrun; eight on 2 loaded cores):
runs with DCPARALLEL_SLOW=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_answers_round_by_round(tmp_path):
    # 60 samples, the longest 2048 tokens: it needs SP 2 under the demo's memory budget
    lengths = [32 + 37 * i % 480 for i in range(57)] + [900, 1500, 2048]
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dcparallel", "demo", "--lengths", str(tmp_path / "lengths.txt")]
    cmd += ["--out", str(out), "--repeats", "2", "--profile-budget", "30", "--tokens-per-step", "4096"]
    cmd += ["--skip-paper-scale", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr
    order = [
        err.index("[demo] plans: the same"),
        err.index("[demo] round 1 of 2, timed run of dcp"),
        err.index("[demo] round 1 of 2, first comparison: one timed run of each policy"),
        err.index("[demo] calibration after round 1, untimed run of bucket"),
        err.index("[demo] round 2 of 2, comparison after 2 timed runs of each policy"),
    ]
    assert order == sorted(order)
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    policies = s["real"]["policies"]
    assert set(policies) == {"bucket", "packed", "dcp"}
    assert len({v["samples_hash"] for v in policies.values()}) == 1  # same samples in the same steps
    assert all(len(v["wall_s_runs"]) == 2 and v["spread"]["runs"] == 2 for v in policies.values())
    assert 0 < s["first_result_s"] < s["demo_s"]
    phases = {"profile", "plan", "warm_up", "rounds", "calibration", "paper_scale", "plots"}
    assert set(s["phase_s"]) >= phases | {"launch"} and set(s["phase_cpu_s"]) >= phases
    assert len(s["phase_s"]["rounds"]) == len(s["phase_cpu_s"]["rounds"]) == 2
    assert 0 < s["phase_cpu_s"]["calibration"] <= 1.05 * s["phase_s"]["calibration"]  # one thread per rank
    report = (out / "report.md").read_text()
    assert "Each policy ran 2 times" in report and "The first comparison was printed after" in report
