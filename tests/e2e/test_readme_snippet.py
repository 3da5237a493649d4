"""The README's ten lines run as written: the ```python block under "Use it: the ten lines" is
cut out of README.md into a script, after a preamble that builds what the README says is the
user's own (a transformers Llama on the CPU, a dataset, its lengths) and before an epilogue
that reports what ran; the script runs under torchrun at 2 ranks with no process-group
set-up of its own (`DataCentricParallel` does it, `runtime.auto_launch`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]

PREAMBLE = """\
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from dcparallel.data.synthetic import SyntheticText

torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
lengths = [16 + (i * 37) % 240 for i in range(48)]
dataset = SyntheticText(lengths, vocab=config.vocab_size)
"""

EPILOGUE = """
import json, math, torch.distributed as dist
assert dist.is_initialized() and dist.get_world_size() == 2
print(json.dumps({"rank": dist.get_rank(), "steps": step.index + 1, "loss": dc.last_loss,
                  "finite": math.isfinite(dc.last_loss)}), flush=True)
"""


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it: the ten lines") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


# about 40 s on 2 cores (a default profile, then one step): with DCPARALLEL_SLOW=1
@pytest.mark.slow
def test_readme_snippet_runs_verbatim_under_torchrun_at_2_ranks(tmp_path):
    pytest.importorskip("transformers")
    snippet = readme_snippet()
    assert "init_process_group" not in snippet and "init_distributed" not in snippet  # no set-up line
    script = tmp_path / "train.py"
    script.write_text(PREAMBLE + snippet + EPILOGUE)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert sorted(d["rank"] for d in out) == [0, 1]
    assert all(d["finite"] and d["steps"] >= 1 for d in out)
    assert out[0]["loss"] == out[1]["loss"]  # one synced mean over both ranks' targets
    assert (tmp_path / "dcparallel_profile.json").exists()  # profiled, cached for the next run
