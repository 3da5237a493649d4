"""`DataCentricParallel.prepare` on library models under torchrun at world 2: a transformers
Llama with grouped-query attention and a diffusers Wan transformer are profiled through their
adapters (no profiling code written for them), planned and trained a few steps; the loss
falls. The same run at world 1 is in-process: tests/unit/test_adapters.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def check_runs(runs: dict, world: int, out_dir) -> None:
    assert set(runs) == {"hf-llama", "wan"}
    for name, d in runs.items():
        assert d["world"] == world and d["profiled"] > 0
        assert len(d["losses"]) >= 4 and d["losses"][-1] < d["losses"][0], (name, d["losses"])
        assert (out_dir / f"{name}.json").exists() or any(out_dir.glob(f"{name}*.json"))


# about 40 s on 2 cores: with DCPARALLEL_SLOW=1 (tests/dist covers prepare at world 2 and 4)
@pytest.mark.slow
def test_prepare_profiles_and_trains_library_models_at_world_2(tmp_path):
    world = 2
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(ROOT / "tests/e2e/prepare_worker.py"),
        str(tmp_path),
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = {d["model"]: d for d in map(json.loads, (x for x in r.stdout.splitlines() if x.startswith("{")))}
    check_runs(runs, world, tmp_path)
