"""`dcparallel train` with ``[lora]`` under torchrun (2 gloo ranks): a local Llama fine-tuned
with LoRA on a chat JSONL, the adapters seeded alike on both ranks (`prepare` refuses replicas
that start apart), the PEFT adapter export loading with `PeftModel.from_pretrained` and
holding the engine's trained adapters."""

import json

import pytest
import torch

from dcparallel.runtime.sharded_checkpoint import read_model
from tests import train_fixtures as tf
from tests.support import torchrun_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_lora_finetune_under_torchrun_exports_the_trained_adapters(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = tf.llama_dir(tmp_path / "model", len(tf.tokenizer()))
    chat = tf.write_jsonl(tmp_path / "chat.jsonl", tf.conversations(24, seed=0))
    config = tf.write_config(
        tmp_path / "run.toml",
        model={"pretrained": model},
        data={"path": chat, "format": "chat", "max_tokens": 64, "eval_fraction": 0.1},
        train={"tokens_per_step": 250, "epochs": 2, "lr": 0.02, "eval_every": 2, "out_dir": tmp_path / "run"},
        lora={"rank": 4, "target_modules": ["q_proj", "v_proj", "gate_proj"]},
        profile={"cost": "analytic"},
    )
    r = torchrun_train(config, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 3 and all(row["world_size"] == 2 for row in rows)
    assert rows[-1]["eval_loss"] is not None
    saved = read_model(sorted((tmp_path / "run" / "checkpoint").glob("step_*"))[-1])
    base = AutoModelForCausalLM.from_pretrained(model, local_files_only=True)
    exported = PeftModel.from_pretrained(base, tmp_path / "run" / "final").eval()
    trained = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model, local_files_only=True), tmp_path / "run" / "final"
    ).eval()
    missing, unexpected = trained.load_state_dict(saved, strict=False)
    assert not unexpected and missing and all("lora_" not in k for k in missing)  # the base: not in the checkpoint
    initial = AutoModelForCausalLM.from_pretrained(model, local_files_only=True).eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (exported, trained, initial))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (a - c).abs().max() > 1e-3
