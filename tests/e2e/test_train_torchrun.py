"""torchrun end to end (2 gloo ranks), in one launch (`launch`, `tests.torchrun_launch.train_each`):

- `dcparallel train --config` profiles, plans, trains a few steps, writes one metrics line
  per step and checkpoints; a second run of the same config with a larger step limit
  resumes from what the first left on disk (checkpoint, profile), as a new launch would
  (resuming in fresh processes is the restart test's: tests/e2e/test_restarts_torchrun.py);
- then `dcparallel profile` profiles SP=1 and SP=2 on the launch's groups, prints its JSON
  once (rank 0) and writes one profile at world 2.

One launch and one set of imports (torch's: about 3 processor seconds a process) for the
three commands instead of three."""

import json
import subprocess
from pathlib import Path

import pytest

from tests.torchrun_launch import run_stderr, torchrun_train_each

pytestmark = pytest.mark.e2e

RUN = """
[model]
num_layers = 2
[data]
lengths = "{lengths}"
[train]
policy = "dcp"
tokens_per_step = 700
max_steps = {max_steps}
memory_mib = 32
out_dir = "{out}"
checkpoint_every = 3
[profile]
repeats = 1
max_repeats = 1
min_time_s = 0
max_mbs = 1
max_tokens = 512
"""
PROFILE = (
    "profile --model tiny-llama --num-layers 3 --buckets 32,64 --modes none,full --repeats 1 --max-repeats 1 "
    "--min-time 0 --max-mbs 1 --json"
)


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, list[Path], subprocess.CompletedProcess]:
    """The launch: train 3 steps, the same run to 5 steps, then `dcparallel profile` into
    ``p.json``. Its folder, the two runs' configs, the launch."""
    tmp = tmp_path_factory.mktemp("torchrun")
    lengths = tmp / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [40, 48, 56, 60, 100, 120, 64, 90] * 6) + "\n")
    configs = [tmp / "run.toml", tmp / "resume" / "run.toml"]
    configs[1].parent.mkdir()
    for config, max_steps in zip(configs, (3, 5), strict=True):
        config.write_text(RUN.format(lengths=lengths, out=tmp / "run", max_steps=max_steps))
    r = torchrun_train_each(configs, tmp, timeout=300, then=[*PROFILE.split(), "--out", str(tmp / "p.json")])
    return tmp, configs, r


def _succeeded(stems: list[Path], r: subprocess.CompletedProcess) -> None:
    """Each command's status on each rank is "0" (else its traceback, and the launch's stderr)."""
    for stem in stems:
        for rank in (0, 1):
            got = stem.with_name(f"{stem.name}_rank{rank}")
            status = got.read_text() if got.exists() else f"no status (launch exit {r.returncode})"
            assert status == "0", f"{got}: {status}\n{r.stderr[-3000:]}"


def test_train_writes_metrics_checkpoints_and_resumes(launch):
    tmp, configs, r = launch
    _succeeded([c.parent / "train_status" for c in configs], r)
    first, second = run_stderr(r.stderr, configs)
    out = tmp / "run"
    assert first.count("profiling now") == 1  # rank 0 speaks; rank 1 logs errors only
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["global_step"] for x in lines] == [1, 2, 3, 4, 5]
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

    # the first run stopped at its limit (step 3, its newest checkpoint), the second resumed there
    assert "resumed" in second and "profiling now" not in second
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [3]
    assert lines[3]["step"] == 3  # continues the epoch where it stopped


def test_torchrun_profile_two_ranks(launch):
    from dcparallel.cost.schema import Profile

    tmp, _, r = launch
    _succeeded([tmp / "then_status"], r)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp / "p.json"
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    d = json.loads(lines[0])
    assert d["world_size"] == 2 and d["profile_path"] == str(out)
    p = Profile.load(out)
    assert p.world_size == 2 and p.fingerprint["sp_sizes"] == [1, 2]
    groups = {(e.bucket, e.sp): tuple(e.ranks) for e in p.entries}
    assert groups == {("t32", 1): (0,), ("t64", 1): (1,), ("t32", 2): (0, 1), ("t64", 2): (0, 1)}
    assert d["layouts_measured"] == len(p.entries) == 8 and p.grad_sync_s > 0
