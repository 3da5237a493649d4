"""An out-of-memory error inside a micro-batch on one rank of an SP group ends every rank
at once (not after the collective timeout), with a message naming the step, the layout and
the samples (runtime/launch.abort_on_oom)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_oom_on_one_rank_ends_every_rank_with_a_message(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    worker = Path(__file__).with_name("oom_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    # the workers' collective timeout is 600 s: finishing within 120 s means the abort ended them
    r = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", str(worker)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "unreachable" not in out
    assert "rank 1: out of memory in step 3 (epoch 0)" in out
    assert "layout sp=2 mbs=2 recompute attn=0 mlp=0 on ranks (0, 1), samples (7, 9)" in out
    assert "exitcode  : 75" in out  # the aborting rank's status, as torchrun reports it
    assert len(list(tmp_path.glob("oom-*-attempt0"))) == 1  # for the restart's lower budget
