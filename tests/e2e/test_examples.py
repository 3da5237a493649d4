"""The examples run as users run them — `torchrun --nproc-per-node 2` on CPU — with a
transformers Llama (GQA), diffusers Wan, LTX-Video and HunyuanVideo transformers on mixed
latent shapes (HunyuanVideo: joint video + text attention, padded captions), and a module
written in the example: each profiles through its own loss function (no profiling code),
plans, trains, and its loss falls. The lines each adds to an ordinary loop are counted."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MARK = re.compile(r"\s# dcparallel\b")  # code lines marked at their end (the docstrings say `# dcparallel`)


# at most ten lines; twelve for the diffusion models, whose loss draws per-sample noise (two lines);
# thirteen for the RL loop, which wraps and prepares a second model, the reference (three lines)
@pytest.mark.parametrize(
    "name,most",
    [
        ("hf_llama", 10),
        ("diffusers_wan", 12),
        ("diffusers_ltx", 12),
        ("diffusers_hunyuanvideo", 12),
        ("custom_model", 10),
        ("rl_grpo", 13),
    ],
)
def test_example_adds_at_most_ten_lines(name, most):
    lines = (EXAMPLES / f"{name}.py").read_text().splitlines()
    marked = [line for line in lines if MARK.search(line)]
    assert 5 <= len(marked) <= most, (name, len(marked), marked)
    # every line dcparallel adds is counted: the import, the process-group set-up, the wrapper, the sync
    for needle in ("import dcparallel", "init_distributed(", "DataCentricParallel(", "sync_gradients()"):
        assert any(needle in line for line in marked), (name, needle)
    uses = re.compile(r"^import dcparallel|\bdcparallel\.\w+\(|\bdc\.\w+\(")  # a call into dcparallel
    unmarked = [line for line in lines if uses.search(line.split("#")[0]) and not MARK.search(line)]
    assert not unmarked, (name, unmarked)


# ~2 minutes each on 2 cores: `DCPARALLEL_SLOW=1 make test` (tests/e2e/test_prepare_torchrun.py is the quick one)
@pytest.mark.slow
@pytest.mark.parametrize(
    "name,env",
    [
        ("hf_llama", {"NUM_SAMPLES": "120"}),
        ("diffusers_wan", {"NUM_SAMPLES": "32", "EPOCHS": "2"}),
        ("diffusers_ltx", {"NUM_SAMPLES": "32", "EPOCHS": "2"}),
        ("diffusers_hunyuanvideo", {"NUM_SAMPLES": "32", "EPOCHS": "2"}),
        ("custom_model", {"NUM_SAMPLES": "120"}),
    ],
)
def test_example_trains_under_torchrun(name, env, tmp_path):
    pytest.importorskip({"hf_llama": "transformers", "custom_model": "torch"}.get(name, "diffusers"))
    run_env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", OUT_DIR=str(tmp_path), **env)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / f"{name}.py"),
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", r.stdout)]
    assert len(losses) >= 3, r.stdout
    assert losses[-1] < losses[0], losses
    assert (tmp_path / f"{name}_profile.json").exists()


# about 40 s on 2 cores (30 GRPO steps, generation included): `DCPARALLEL_SLOW=1 make test`
@pytest.mark.slow
def test_rl_example_reward_rises_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", STEPS="30")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLES / "rl_grpo.py"),
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rewards = [float(x) for x in re.findall(r"reward ([0-9.]+)", r.stdout)]
    assert len(rewards) == 30, r.stdout
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, rewards
    sps = {int(x) for group in re.findall(r"SP degrees \[([0-9, ]+)\]", r.stdout) for x in group.split(",")}
    assert sps == {1, 2}, sps  # long rollouts ran on SP=2 groups in some step
