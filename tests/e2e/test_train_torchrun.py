"""`dcparallel train --config` under torchrun (2 gloo ranks): profiles, plans, trains a few
steps, writes one metrics line per step and checkpoints; a second launch resumes."""

import json

import pytest

from tests.torchrun_launch import torchrun_train

pytestmark = pytest.mark.e2e


def test_train_writes_metrics_checkpoints_and_resumes(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [40, 48, 56, 60, 100, 120, 64, 90] * 6) + "\n")
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[model]
num_layers = 2
[data]
lengths = "{lengths}"
[train]
policy = "dcp"
tokens_per_step = 700
max_steps = 3
memory_mib = 32
out_dir = "{out}"
checkpoint_every = 3
[profile]
repeats = 1
max_repeats = 1
min_time_s = 0
max_mbs = 1
max_tokens = 512
""")
    r = torchrun_train(config, tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("profiling now") == 1  # rank 0 speaks; rank 1 logs errors only
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["global_step"] for x in lines] == [1, 2, 3]
    for x in lines:
        assert {"loss", "tokens_per_s", "step_s", "idle_fraction", "planned_peak_memory_bytes", "sp_degrees"} <= set(x)
        assert 0 <= x["idle_fraction"] <= 1 and x["tokens_per_s"] > 0 and x["planned_peak_memory_bytes"] <= 32 * 2**20
    assert sorted(x.name for x in (out / "checkpoint" / "step_00000003").iterdir()) == [
        ".metadata",
        "COMMIT.json",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng0.pt",
        "rng1.pt",
    ]
    assert (out / "profile.json").exists() and (out / "profile.world2.json").exists()

    # the same config with a larger step limit resumes after step 3 and reuses the profile
    config.write_text(config.read_text().replace("max_steps = 3", "max_steps = 5"))
    r = torchrun_train(config, tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed" in r.stderr and "profiling now" not in r.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["global_step"] for x in lines] == [1, 2, 3, 4, 5]
    assert lines[3]["step"] == 3  # continues the epoch where it stopped
