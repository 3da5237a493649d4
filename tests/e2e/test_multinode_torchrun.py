"""Two "nodes" on this machine: two torchrun agents of 2 ranks each meet in one c10d
rendezvous on 127.0.0.1 and train the reference LM on hand-made plans whose SP=4 group
spans the node boundary (GPUs per node = LOCAL_WORLD_SIZE = 2), then SP=2 groups inside
the nodes with an idle group, then SP=1 groups with uneven counts; the gradient sync is
bucketed and overlapped. The losses must equal a one-process run of the same samples up to
fp32 rounding (the exact-gradient contract; the 2-rank smoke test measured ~3e-7)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]

#: each of the three layouts once (`hand_made_plan` cycles through them by step % 3), then the
#: first again: a step's gradients show only in the next step's loss, so the third layout's need
#: a fourth step
STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_one_c10d_rendezvous_groups_span_nodes(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    port = _free_port()
    args = [str(ROOT / "tests/e2e/smoke_worker.py"), "--steps", str(STEPS), "--bucket-kib", "8", "--out", "losses.json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    agents = []
    for node in range(2):
        cmd = [
            torchrun,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "dcp-two-nodes",
            "--max-restarts",
            "0",
            *args,
        ]
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        agents.append(
            (subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), cwd)
        )
    outputs = []
    try:
        for proc, _ in agents:
            out, _ = proc.communicate(timeout=240)
            outputs.append(out)
    finally:
        for proc, _ in agents:
            if proc.poll() is None:
                proc.kill()
    for (proc, _), out in zip(agents, outputs, strict=True):
        assert proc.returncode == 0, out[-4000:]
    # global rank 0 lives on whichever agent the rendezvous made node 0
    files = [cwd / "losses.json" for _, cwd in agents if (cwd / "losses.json").exists()]
    assert len(files) == 1
    two_nodes = json.loads(files[0].read_text())
    assert two_nodes["world_size"] == 4 and len(two_nodes["losses"]) == STEPS
    log = "".join(outputs)
    assert "nodes 2" in log and "groups 4 " in log  # the SP=4 group over both nodes ran
    one = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    ref = json.loads((tmp_path / "losses.json").read_text())["losses"]
    assert max(abs(a - b) / a for a, b in zip(ref, two_nodes["losses"], strict=True)) < 1e-4
