"""`dcparallel simulate` and `plan` as a user runs them: JSON last on stdout, logs on stderr."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

KEYS = {
    "samples_planned",
    "samples_dropped",
    "steps",
    "tokens_per_s",
    "step_time_s_median",
    "idle_fraction",
    "lower_bound_efficiency",
    "plan_ms_per_step",
    "plan_ms_max",
    "plan_first_step_ms",
    "setup_ms",
    "peak_memory_fraction",
}


def _run(*args: str, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *python, "-m", "dcparallel", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("l") / "heavy_tail.txt"
    sizes = [256] * 300 + [4096] * 40 + [32768] * 8 + [131072] * 3
    p.write_text("\n".join(map(str, sizes)) + "\n")
    return p


def test_simulate_json_from_lengths_file(lengths_file):
    r = _run("simulate", "--lengths", str(lengths_file), "--world", "16", "--all", "--json")
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    assert out["distribution"] == "heavy_tail.txt" and out["scenario"] == "text" and out["world"] == 16
    assert out["samples_total"] == 351
    for name, v in out["policies"].items():
        assert KEYS <= set(v), name
        assert v["samples_planned"] == 351 and v["samples_dropped"] == 0
    assert out["bucket_sp"] in (1, 2, 4, 8, 16)
    assert out["speedup_vs_bucket"]["bucket"] == 1.0
    assert "steady state" in out["plan_time_includes"] and "first step" in out["plan_time_includes"]
    assert "planning" in r.stderr  # progress goes to stderr


def test_simulate_scenario_table():
    r = _run(
        "simulate",
        "--scenario",
        "video",
        "--distribution",
        "long",
        "--policy",
        "bucket",
        "--policy",
        "dcp",
        "--quiet",
        "--world",
        "8",
    )
    assert r.returncode == 0, r.stderr
    assert "vs bucket" in r.stdout and "dcp" in r.stdout and "bucket" in r.stdout


def test_plan_json_lists_groups_and_predictions(lengths_file):
    r = _run(
        "plan",
        "--lengths",
        str(lengths_file),
        "--world",
        "8",
        "--policy",
        "dcp-inter-pac",
        "--steps",
        "2",
        "--json",
        "--tokens-per-step",
        "200000",
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert len(lines) == 2
    for d in lines:
        ranks = sorted(x for g in d["groups"] for x in g["ranks"])
        assert ranks == list(range(8))
        ids = sorted(i for g in d["groups"] for mb in g["micro_batches"] for i in mb["sample_ids"])
        assert ids == sorted(d["sample_ids"])
        assert d["predicted_step_s"] > 0 and all("predicted_s" in mb for g in d["groups"] for mb in g["micro_batches"])


def test_bad_lengths_file_is_a_clear_error_and_simulate_never_imports_torch(tmp_path):
    """The error names the sample; and `simulate` (like `plan`) runs on the pure core: torch,
    about 3 s of CPU to import, is never loaded (`-X importtime` lists every import)."""
    p = tmp_path / "bad.txt"
    p.write_text("100\n-5\n")
    r = _run("simulate", "--lengths", str(p), "--json", python=("-X", "importtime"))
    assert r.returncode == 2 and "sample 1" in r.stderr and "positive integer" in r.stderr
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert "dcparallel.apps.simulate" in imported and "torch" not in imported


def test_table_without_bucket_says_so_instead_of_nan():
    from dcparallel.apps.simulate import _table

    row = {
        "settings": {},
        "tokens_per_s": 1e6,
        "step_time_s_median": 1.5,
        "idle_fraction": 0.1,
        "lower_bound_efficiency": 0.9,
        "plan_ms_per_step": 2.0,
        "plan_first_step_ms": 9.0,
        "setup_ms": 30.0,
        "peak_memory_fraction": 0.5,
    }
    out = {
        "scenario": "text",
        "distribution": "short",
        "samples_total": 10,
        "steps": 2,
        "tokens_per_step": 1000,
        "world": 8,
        "gpus_per_node": 8,
        "long_token_share": 0.0,
        "policies": {"dcp": row, "packed": row},
    }
    text = _table(out)
    assert "nan" not in text and "add --policy bucket" in text
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines()[2:4]}
    assert lines["dcp"][1] == "-" and lines["packed"][1] == "-"
    out["speedup_vs_bucket"] = {"dcp": 1.234, "packed": 1.0}
    text = _table(out)
    assert "add --policy bucket" not in text and text.splitlines()[2].split()[1] == "1.23x"


def test_planning_time_is_the_steady_state_median_with_first_step_and_setup_apart():
    """`simulate` and `benchmarks/plan_cpu_time.py` time planning through one function: CPU
    ms per step, the first step apart from the steady state (the later steps)."""
    from dcparallel.sim.run import PLAN_TIME_NOTE, timed_plans

    ticks = iter([0.0, 0.050, 1.0, 1.002, 2.0, 2.004, 3.0, 3.030])  # steps of 50, 2, 4 and 30 ms
    plans, t = timed_plans(lambda s: f"plan {s}", ["a", "b", "c", "d"], setup_ms=7.0, clock=lambda: next(ticks))
    assert plans == ["plan a", "plan b", "plan c", "plan d"]
    assert t.setup_ms == 7.0 and abs(t.first_step_ms - 50) < 1e-9
    assert [round(x, 6) for x in t.steady_ms] == [2.0, 4.0, 30.0]
    assert abs(t.steady_median_ms - 4.0) < 1e-9 and abs(t.steady_max_ms - 30.0) < 1e-9
    one = timed_plans(lambda s: s, ["a"])[1]  # one step: the first is all there is
    assert one.steady_ms == () and one.steady_median_ms == one.first_step_ms
    for words in ("CPU", "median", "steady state", "first step", "setup"):
        assert words in PLAN_TIME_NOTE
    from dcparallel.apps import simulate as cli

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_cpu_time.py"
    assert "timed_plans" in bench.read_text()  # the benchmark times the same way
    row = {
        "settings": {},
        "tokens_per_s": 1e6,
        "step_time_s_median": 1.5,
        "idle_fraction": 0.1,
        "lower_bound_efficiency": 0.9,
        "plan_ms_per_step": 4.0,
        "plan_first_step_ms": 50.0,
        "setup_ms": 7.0,
        "peak_memory_fraction": 0.5,
    }
    text = cli._table(
        {
            "scenario": "text",
            "distribution": "short",
            "samples_total": 10,
            "steps": 4,
            "tokens_per_step": 1000,
            "world": 8,
            "gpus_per_node": 8,
            "long_token_share": 0.0,
            "policies": {"dcp": row},
        }
    )
    assert text.splitlines()[-1] == PLAN_TIME_NOTE + "; first step and setup ms: dcp 50.0 / 7"
