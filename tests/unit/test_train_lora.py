"""`dcparallel train` with a ``[lora]`` section, in-process at world 1: a local Llama
fine-tuned with LoRA on a chat JSONL, checkpointed, resumed, and exported as the PEFT adapter
folder (`PeftModel.from_pretrained` loads it) and merged weights; the section's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcparallel.apps.train import run
from dcparallel.apps.train_config import Config
from tests import train_fixtures as tf

pytest.importorskip("peft")
pytest.importorskip("transformers")


def _config(root: Path, max_steps: int, model: Path | None = None) -> Path:
    root.mkdir(exist_ok=True)
    model = model or tf.llama_dir(root / "model", len(tf.tokenizer()))
    chat = tf.write_jsonl(root / "chat.jsonl", tf.conversations(16, seed=0))
    return tf.write_config(
        root / "run.toml",
        model={"pretrained": model},
        data={"path": chat, "format": "chat", "max_tokens": 64},
        train={
            "tokens_per_step": 300,
            "epochs": 2,
            "max_steps": max_steps,
            "lr": 0.02,
            "checkpoint_every": 2,
            "out_dir": root / "run",
            "export_dir": root / "final",
        },
        lora={"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"], "export_merged": True},
        profile={"cost": "analytic"},
    )


def _rows(root: Path) -> list[dict]:
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("step_s"), r.pop("tokens_per_s"), r.pop("idle_fraction")
    return rows


def test_lora_finetune_resumes_and_exports_the_peft_adapter_and_merged_weights(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert run(Config.load(_config(straight, 4))) == 0
    model = straight / "model"
    assert run(Config.load(_config(resumed, 2, model))) == 0  # stops at step 2 (checkpoint)
    assert run(Config.load(_config(resumed, 4, model))) == 0  # resumes from it
    events = [json.loads(x) for x in (resumed / "run" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "resume" for e in events), events
    rows = _rows(straight)
    assert len(rows) == 4 and _rows(resumed) == rows

    # the checkpoint holds the adapters (not the frozen base) and their optimizer state only
    from dcparallel.runtime.sharded_checkpoint import read_model, read_state

    folder = sorted((straight / "run" / "checkpoint").glob("step_*"))[-1]
    saved = read_model(folder)
    adapters = {k: v for k, v in saved.items() if "lora_" in k}
    assert set(saved) == set(adapters), sorted(saved)
    moments = {k: v for k, v in read_state(folder, "optim/").items() if k.endswith("/exp_avg")}
    # 2 layers of rank-4 A, B on q (32 -> 32), v (32 -> 16) and down (64 -> 32) projections
    assert (
        sum(v.numel() for v in moments.values()) == sum(v.numel() for v in adapters.values()) == 2 * 4 * (64 + 48 + 96)
    )

    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    base = AutoModelForCausalLM.from_pretrained(model, local_files_only=True).eval()
    with torch.no_grad():
        before = base(input_ids=ids).logits
    peft = PeftModel.from_pretrained(base, straight / "final").eval()
    trained = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model, local_files_only=True), straight / "final"
    ).eval()
    missing, unexpected = trained.load_state_dict(saved, strict=False)
    assert not unexpected and missing and all("lora_" not in k for k in missing)  # the base: not checkpointed
    merged = AutoModelForCausalLM.from_pretrained(straight / "final" / "merged", local_files_only=True).eval()
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (peft, trained, merged))
    assert (a - before).abs().max() > 1e-3  # the adapters changed the model
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # the export holds the trained adapters
    torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)  # merged: the same function
    assert (straight / "final" / "tokenizer_config.json").exists()
    # `dcparallel export` of the last checkpoint writes the same adapters
    from dcparallel.apps.train_export import export_run

    again = export_run(straight / "run.toml", out=tmp_path / "again")
    with torch.no_grad():
        d = (
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, local_files_only=True), again)
            .eval()(input_ids=ids)
            .logits
        )
    torch.testing.assert_close(d, a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "lora,match",
    [
        ({"target_modules": ["q_proj"]}, "rank = 0"),
        ({"rank": 4, "target_modules": "q_proj"}, "must be a list"),
        ({"rank": 4, "dropout": 1.0}, "dropout"),
    ],
)
def test_lora_section_errors_name_the_fix(lora, match):
    with pytest.raises(ValueError, match=match):
        Config.from_dict({"lora": lora})


def test_lora_on_the_reference_model_is_refused(tmp_path):
    from dcparallel.apps.train_setup import load_model

    cfg = Config.from_dict({"lora": {"rank": 4}})
    with pytest.raises(ValueError, match="transformers or diffusers"):
        load_model(cfg, torch.device("cpu"))


@pytest.mark.slow  # 8 s: a Wan run at world 1 (make test keeps the Llama one)
def test_lora_finetune_of_a_diffusers_wan_exports_its_peft_adapter(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    from diffusers import WanTransformer3DModel
    from peft import PeftModel

    config = tf.wan_run(tmp_path, copies=1, tokens_per_step=60, schedule="constant")
    text = config.read_text().replace("epochs = 3", "epochs = 1").replace("wandb = true", "wandb = false")
    config.write_text(
        text.replace("tensorboard = true", "tensorboard = false") + "[lora]\nrank = 4\nexport_merged = true\n"
    )
    assert run(Config.load(config)) == 0
    rows = _rows(tmp_path)
    assert rows and all(r["loss"] > 0 for r in rows)
    from dcparallel.runtime.sharded_checkpoint import read_model, read_state

    folder = sorted((tmp_path / "run" / "checkpoint").glob("step_*"))[-1]
    saved = read_model(folder)
    moments = {k: v for k, v in read_state(folder, "optim/").items() if k.endswith("/exp_avg")}
    assert sum(v.numel() for v in moments.values()) == sum(v.numel() for k, v in saved.items() if "lora_" in k)
    base = WanTransformer3DModel.from_pretrained(tmp_path / "wan", local_files_only=True)
    peft = PeftModel.from_pretrained(base, tmp_path / "run" / "final").eval()
    trained = PeftModel.from_pretrained(
        WanTransformer3DModel.from_pretrained(tmp_path / "wan", local_files_only=True), tmp_path / "run" / "final"
    ).eval()
    missing, unexpected = trained.load_state_dict(saved, strict=False)
    assert not unexpected and missing and all("lora_" not in k for k in missing)  # the base: not in the checkpoint
    merged = WanTransformer3DModel.from_pretrained(tmp_path / "run" / "final" / "merged", local_files_only=True).eval()
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(1, 4, 2, 4, 4, generator=g), torch.randn(1, 4, 16, generator=g)
    with torch.no_grad():
        a, b, c = (
            m(x, timestep=torch.tensor([500.0]), encoder_hidden_states=ctx, return_dict=False)[0]
            for m in (peft, trained, merged)
        )
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
