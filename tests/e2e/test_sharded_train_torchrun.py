"""`dcparallel train` with parameters sharded in blocks (shard_size > 1) under torchrun on gloo:
a local transformers Llama (built on the meta device, its weights read shard by shard: the
first step's loss is that of the model loaded whole) fine-tuned on a chat JSONL checkpoints through
torch.distributed.checkpoint at world 4 with shard size 2, resumes at world 2 with shard size
2 and then at world 4 with shard size 4; every step trains the samples of an uninterrupted
world-4 / shard-size-2 run, none lost or repeated, with its loss to fp32 reduction order. The
model exported at the end loads with ``from_pretrained`` and gives the logits of the trained
parameters in the last checkpoint; `dcparallel export` of that checkpoint writes the same
weights and the tokenizer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import train_fixtures as tf

# up to seven torch processes per launch, five launches: about 2.5 minutes on two free cores
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def _launch(config: Path, world: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "-m",
        "dcparallel",
        "train",
        "--config",
        str(config),
    ]
    return subprocess.run(cmd, cwd=config.parent, env=ENV, capture_output=True, text=True, timeout=600)


def _config(root: Path, name: str, max_steps: int, shard_size: int) -> Path:
    config = root / f"{name}.toml"
    config.write_text(f"""
[model]
pretrained = "{root / "model"}"
[data]
path = "{root / "chat.jsonl"}"
format = "chat"
max_tokens = 64
[train]
tokens_per_step = 300
epochs = 3
max_steps = {max_steps}
lr = 0.01
max_grad_norm = 1.0
checkpoint_every = 2
shard_size = {shard_size}
out_dir = "{root / name}"
[profile]
cost = "analytic"
""")
    return config


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_sharded_run_resumes_at_other_world_and_shard_sizes_and_exports(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dcparallel import checkpoint
    from dcparallel.runtime.sharded_checkpoint import read_model

    tf.llama_dir(tmp_path / "model", len(tf.tokenizer()))
    tf.write_jsonl(tmp_path / "chat.jsonl", tf.conversations(40, seed=0))
    r = _launch(_config(tmp_path, "ref", 6, 2), 4)
    assert r.returncode == 0, r.stderr[-4000:]
    # shard_size 2: the model was built on the meta device and read shard by shard; its first
    # step's loss is that of the model loaded whole (shard_size 1), so the weights are the folder's
    events = [json.loads(x) for x in (tmp_path / "ref" / "events.jsonl").read_text().splitlines()]
    assert [e["loaded_on_meta"] for e in events if e["event"] == "start"] == [True]
    r = _launch(_config(tmp_path, "whole", 1, 1), 2)
    assert r.returncode == 0, r.stderr[-4000:]
    first, whole = _metrics(tmp_path / "ref")[0], _metrics(tmp_path / "whole")[0]
    assert first["sample_ids"] == whole["sample_ids"]
    assert abs(first["loss"] - whole["loss"]) <= 1e-5 * abs(whole["loss"]), (first["loss"], whole["loss"])
    for world, max_steps, s in [(4, 2, 2), (2, 4, 2), (4, 6, 4)]:
        r = _launch(_config(tmp_path, "el", max_steps, s), world)
        assert r.returncode == 0, (world, s, r.stderr[-4000:])
        ck = checkpoint.latest(tmp_path / "el" / "checkpoint")
        assert (ck.version, ck.step, ck.world_size, ck.shard_size) == (checkpoint.VERSION_DCP, max_steps, world, s)
    assert "resharded the checkpoint of shard size 2 to shard size 4" in r.stderr

    a, b = _metrics(tmp_path / "ref"), _metrics(tmp_path / "el")
    assert [m["global_step"] for m in b] == [1, 2, 3, 4, 5, 6]
    assert [m["world_size"] for m in b] == [4, 4, 2, 2, 4, 4]
    assert [m["sample_ids"] for m in b] == [m["sample_ids"] for m in a]  # the same samples in every step
    for epoch in {m["epoch"] for m in b}:  # no sample twice in an epoch
        ids = [i for m in b if m["epoch"] == epoch for i in m["sample_ids"]]
        assert len(ids) == len(set(ids)), epoch
    # fp32 sums in another order (other SP groups and shard sizes), grown by a few Adam steps:
    # measured below 1e-6 relative; a lost or repeated sample moves a step's loss by > 1e-2
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["global_step"], x["loss"], y["loss"])

    # the export at the end holds the trained parameters (those of the final checkpoint)
    last = checkpoint.latest(tmp_path / "el" / "checkpoint")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True).eval()
    with torch.no_grad():
        for name, value in read_model(last.path).items():
            trained.get_parameter(name).copy_(value)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "el" / "final", local_files_only=True).eval()
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "el" / "final", local_files_only=True)
    ids = torch.tensor(
        [
            tok.apply_chat_template(tf.conversations(1, seed=9)[0]["messages"], tokenize=True, return_dict=True)[
                "input_ids"
            ]
        ]
    )
    with torch.no_grad():
        x, y, z = (m(input_ids=ids).logits for m in (initial, exported, trained))
    assert (x - y).abs().max() > 1e-2  # fine-tuned
    torch.testing.assert_close(y, z, rtol=1e-5, atol=1e-5)  # fp32: the same weights

    # `dcparallel export` of the committed checkpoint, in one process: the same weights
    from dcparallel.apps.cli import main

    assert main(["export", "--config", str(tmp_path / "el.toml"), "--out", str(tmp_path / "exported")]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True)
    assert AutoTokenizer.from_pretrained(tmp_path / "exported", local_files_only=True).get_vocab() == tok.get_vocab()
    for (n1, p1), (n2, p2) in zip(exported.state_dict().items(), again.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1
