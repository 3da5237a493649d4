"""benchmarks/tools/device_check.py --dry-run: every part of the device check on CPU / gloo with tiny
sizes, in one process (varlen_attn and FlexAttention's backward are GPU-only: the SDPA
fallback and the forward are checked; the sharded runtime needs two GPUs: reported skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).parents[2]


def _device_check():
    """benchmarks/tools/device_check.py as a module (benchmarks/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "tools" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dry_run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "tools" / "device_check.py"),
            "--dry-run",
            "--out",
            str(out),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=700,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )


def test_the_gpu_budgets_fit_the_device_time():
    device_check = _device_check()

    assert sum(b for _, b in device_check.BUDGETS.values()) <= 8 * 60 == device_check.DEVICE_SECONDS
    assert list(device_check.BUDGETS) == list("abcdefg")
    with pytest.raises(SystemExit, match="unknown part"):
        device_check.main(["--dry-run", "--parts", "a,x"])


def test_a_part_past_its_budget_is_killed_and_reports_what_it_saved(tmp_path, monkeypatch):
    device_check = _device_check()

    fake = tmp_path / "parts.py"  # saves a first result, then hangs in a child process
    fake.write_text(
        "import json, subprocess, sys\nfrom pathlib import Path\n"
        "Path(sys.argv[3], 'part_d.json').write_text(json.dumps({'short': 1}))\n"
        "subprocess.run([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    )
    (tmp_path / "part_d.json").write_text(json.dumps({"former": "run"}))
    monkeypatch.setattr(device_check, "PARTS_SCRIPT", fake)
    monkeypatch.setattr(device_check, "DRY_LIMIT_S", 3)
    res = device_check.run_part("d", tmp_path, dry=True)
    assert res["error"].startswith("timed out after its 3 s budget") and res["partial"] == {"short": 1}


def test_parts_sharing_a_process_report_each_ones_error(tmp_path, monkeypatch):
    device_check = _device_check()

    fake = tmp_path / "parts.py"  # part (a) raised and (b) finished in one process; (c) never started
    fake.write_text(
        "import json, sys\nfrom pathlib import Path\nout = Path(sys.argv[3])\n"
        "(out / 'part_a.json').write_text(json.dumps({'part_error': 'ValueError: a', 'part_seconds': 1.0}))\n"
        "(out / 'part_b.json').write_text(json.dumps({'steps': 3, 'part_seconds': 2.0}))\n"
        "print('the log'); sys.exit(1)\n"
    )
    monkeypatch.setattr(device_check, "PARTS_SCRIPT", fake)
    res = device_check.run_parts(["a", "b", "c"], tmp_path, dry=True)
    assert res["a"]["error"].startswith("ValueError: a\nthe log") and res["a"]["seconds"] == 1.0
    assert res["b"] == {"steps": 3, "seconds": 2.0}
    assert res["c"]["error"].startswith("exit 1\nthe log") and res["c"]["partial"] is None


def test_device_check_dry_run_writes_every_part(tmp_path, monkeypatch):
    r = _dry_run(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GPU budgets of all parts: 480 s" in r.stderr
    report = next(tmp_path.glob("device-check_cpu_*.md")).read_text()
    assert "FAILED" not in report and "DRY RUN" in report and "not run" not in report
    res = json.loads(next(tmp_path.glob("device-check_cpu_*.json")).read_text())
    assert res["a"]["returncode"] == 0 and "time_error" in res["a"]["table"]
    for model in ("reference", "transformers"):
        steps = res["b"][model]["steps"]
        assert len(steps) == 3 and all(s["planned_compute_s"] > 0 and s["planned_peak_memory_bytes"] > 0 for s in steps)
    c2 = res["c"]["world2"]
    assert c2["backend"] == "gloo" and c2["within_1e-2"] and c2["max_rel_grad_err"] <= 1e-5
    # ZeRO-1: every bucket but the loss / count slots reduced into one owner; rank 0 receives its
    # half; the norm clipped on the shards is world 1's to the gradients' own 1e-5 (other layouts)
    sync = c2["sync"]
    assert sync["sharded"] and sync["all_reduced"] == 1 and sync["overlapped_buckets"] == sync["buckets"]
    assert sync["bytes_summed_into_rank0"] <= 0.5 * sync["buffer_bytes"] + 8 and c2["grad_norm_rel_err"] <= 1e-5
    # rank 1's out-of-memory error (a raised stand-in on CPU) ends both ranks with its message
    assert c2["oom"]["rank1_message"] and c2["oom"]["stopped_every_rank"], c2["oom"]
    # on CPU the package's kernel is the reference's own path in fp32: errors against fp64 are
    # fp32 rounding (~1e-7); FlexAttention's forward (its backward is GPU-only) agrees as closely
    assert set(res["d"]["long_7"]) < set(res["d"]["short_256x64"]) and len(res["d"]["short_256x64"]) == 7
    for layout in ("short_256x64", "long_7"):
        for case, d in res["d"][layout].items():
            errs = [d["rel_err_out"], d["rel_err_dq"], d["rel_err_dk"], d["rel_err_dv"]]
            assert d["kernel"] in ("loop", "eager") and max(errs) <= 1e-6, (layout, case, d)
            assert ("rel_err_dsinks" in d) == case.startswith("gpt-oss")
    assert res["d"]["short_256x64"]["gemma2-softcap"]["flex_forward_rel_err_out"] <= 1e-6
    assert res["d"]["long_7"]["gpt-oss-sinks-window"]["flex_forward_rel_err_out"] <= 1e-6
    e = res["e"]
    assert e["all_reduce"] == 12.0 and e["broadcast_object_list"] == {"plan": [1, 2, 3]}
    assert e["engine_step"]["loss"] > 0
    # bf16 parameters, fp32 gradients, master weights and moments: 18 bytes a parameter, and
    # every CPU tensor storage alive after the step (a few token ids besides) within 1% of it
    f = res["f"]
    assert f["bytes_per_param"]["recipe_states_bytes"] == 18 and 1 <= f["held_after_vs_recipe_states"] <= 1.01
    assert res["g"]["skipped"].startswith("skipped: sharding needs ≥ 2 GPUs in a node")
    _rerun_keeps_the_other_parts(tmp_path, res, monkeypatch)


def _rerun_keeps_the_other_parts(out: Path, before: dict, monkeypatch) -> None:
    """A run of some parts replaces theirs in the folder's report and keeps the others; a part
    never run reads "not run". Only the orchestrator is under test here: a stand-in for the
    parts' script saves part (g) (the parts' own code ran in the dry run before)."""
    device_check = _device_check()
    fake = out / "fake_parts.py"
    fake.write_text(
        "import json, sys\nfrom pathlib import Path\n"
        "Path(sys.argv[3], 'part_g.json').write_text(json.dumps({'skipped': 'again', 'part_seconds': 0.5}))\n"
    )
    monkeypatch.setattr(device_check, "PARTS_SCRIPT", fake)
    assert device_check.main(["--dry-run", "--parts", "g", "--out", str(out / "alone")]) == 0
    assert device_check.main(["--dry-run", "--parts", "g", "--out", str(out)]) == 0
    assert next((out / "alone").glob("device-check_cpu_*.md")).read_text().count("not run") == 6  # (a)-(f)
    res = json.loads(next(out.glob("device-check_cpu_*.json")).read_text())
    assert res["g"] == {"skipped": "again", "seconds": 0.5}
    assert all(res[k] == before[k] for k in "abcdef")


@pytest.mark.slow
def test_sharded_part_runs_on_two_cpu_processes(tmp_path):
    """Part (e)'s torchrun worker on gloo (what a multi-GPU node runs with NCCL): the sharded
    engine's step equals the replicated one's, and parameters + gradients take 1/s per rank."""
    out = tmp_path / "e.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            str(ROOT / "benchmarks" / "tools" / "sharded_device_check.py"),
            "--dry-run",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["shard_size"] == 2 and res["parity"]["max_rel_grad_err"] <= 1e-5
    assert abs(res["parity"]["loss_sharded"] - res["parity"]["loss_replicated"]) <= 1e-5
    assert res["storage"]["fraction_of_replicated"] <= 0.5 * 1.05 and res["step_s"] > 0
