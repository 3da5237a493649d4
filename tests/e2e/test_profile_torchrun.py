"""torchrun end to end: `dcparallel profile` inside a 2-rank launch profiles SP=1 and SP=2
on the launch's groups, prints its JSON once (rank 0) and writes one profile at world 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcparallel.cost.schema import Profile

pytestmark = pytest.mark.e2e


def test_torchrun_profile_two_ranks(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = tmp_path / "p.json"
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "dcparallel",
        "profile",
        "--model",
        "tiny-llama",
        "--num-layers",
        "3",
        "--buckets",
        "32,64",
        "--modes",
        "none,full",
        "--repeats",
        "1",
        "--max-repeats",
        "1",
        "--min-time",
        "0",
        "--max-mbs",
        "1",
        "--json",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    assert d["world_size"] == 2 and d["profile_path"] == str(out)
    p = Profile.load(out)
    assert p.world_size == 2 and p.fingerprint["sp_sizes"] == [1, 2]
    groups = {(e.bucket, e.sp): tuple(e.ranks) for e in p.entries}
    assert groups == {("t32", 1): (0,), ("t64", 1): (1,), ("t32", 2): (0, 1), ("t64", 2): (0, 1)}
    assert d["layouts_measured"] == len(p.entries) == 8 and p.grad_sync_s > 0
