"""benchmarks/device_check.py --dry-run: the H200 check's code on CPU with tiny sizes; every
part (a)-(e) writes its section (varlen_attn is GPU-only: its CPU error is reported; the
sharded runtime needs two GPUs or more: reported as skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).parents[2]


# about 55 s on 2 cores: with DCPARALLEL_SLOW=1 (run it before a device session)
@pytest.mark.slow
def test_device_check_dry_run_writes_every_part(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--dry-run", "--out-dir",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    report = next(tmp_path.glob("device-check_cpu_*.md")).read_text()
    for title in ("(a) profile --validate", "(b) varlen_attn", "(c) training steps", "(d) PAC", "(e) sharded runtime"):
        assert title in report
    assert "FAILED" not in report and "DRY RUN" in report
    res = json.loads(next(tmp_path.glob("device-check_cpu_*.json")).read_text())
    assert res["a"]["returncode"] == 0 and "time_error" in res["a"]["table"]
    assert res["b"]["sdpa_loop_fwd_bwd_s"] > 0 and "varlen_error" in res["b"]  # GPU-only kernel
    steps = res["c"]["steps"]
    assert len(steps) == 3 and all(s["planned_compute_s"] > 0 and s["planned_peak_memory_bytes"] > 0 for s in steps)
    assert all(s["measured_peak_memory_bytes"] is None for s in steps)  # CUDA only
    assert "errors" not in res["c"], res["c"].get("errors")
    for family in ("transformers", "diffusers"):  # the adapters' model families train too
        assert len(res["c"][family]) == 3 and all(s["planned_compute_s"] > 0 for s in res["c"][family])
    assert res["d"]["none_s"] > 0 and res["d"]["full_s"] > 0
    assert res["e"]["skipped"].startswith("skipped: sharding needs ≥ 2 GPUs in a node")  # no GPU in the dry run


@pytest.mark.slow
def test_sharded_part_runs_on_two_cpu_processes(tmp_path):
    """Part (e)'s torchrun worker on gloo (what a multi-GPU node runs with NCCL): the sharded
    engine's step equals the replicated one's, and parameters + gradients take 1/s per rank."""
    out = tmp_path / "e.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        str(ROOT / "benchmarks" / "sharded_device_check.py"), "--dry-run", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["shard_size"] == 2 and res["parity"]["max_rel_grad_err"] <= 1e-5
    assert abs(res["parity"]["loss_sharded"] - res["parity"]["loss_replicated"]) <= 1e-5
    assert res["storage"]["fraction_of_replicated"] <= 0.5 * 1.05 and res["step_s"] > 0
