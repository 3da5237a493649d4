"""`dcparallel train` fine-tuning a local pretrained model on a real dataset, in-process at
world 1 (the 2-rank torchrun run: tests/e2e/test_finetune_torchrun.py), and the config's
errors for pretrained directories and real data."""

from __future__ import annotations

import json

import pytest
import torch

from dcparallel.apps.train import run
from dcparallel.apps.train_config import Config
from dcparallel.runtime.sharded_checkpoint import read_model
from tests import faults
from tests import train_fixtures as tf

pytest.importorskip("transformers")
pytest.importorskip("tensorboard")


@pytest.mark.slow  # the same run at world 2: tests/e2e/test_finetune_torchrun.py
def test_finetune_chat_world1_with_schedule_clipping_eval_tensorboard_export(tmp_path):
    config = tf.chat_run(tmp_path, world=1)
    assert run(Config.load(config)) == 0
    rows = tf.check_chat_run(tmp_path)
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "finish" and events[-1]["export_dir"] == str(tmp_path / "final")
    # a second launch finds the finished run and changes nothing
    assert run(Config.load(config)) == 0
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == len(rows)


@pytest.mark.slow  # the same run at world 2: tests/e2e/test_finetune_torchrun.py
def test_finetune_wan_world1_from_a_latents_manifest_with_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("diffusers")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from diffusers import WanTransformer3DModel

    config = tf.wan_run(tmp_path, copies=3, tokens_per_step=60, schedule="linear")
    assert run(Config.load(config)) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 4 and sum(r["loss"] for r in rows[-2:]) < sum(r["loss"] for r in rows[:2])
    assert any(r["eval_loss"] is not None for r in rows) and rows[-1]["eval_loss"] is not None
    assert any(r["grad_norm"] > 0.5 for r in rows)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    exported = WanTransformer3DModel.from_pretrained(tmp_path / "run" / "final", local_files_only=True)
    last = sorted((tmp_path / "run" / "checkpoint").glob("step_*"))[-1]
    trained = read_model(last)  # the engine's trained weights
    initial = WanTransformer3DModel.from_pretrained(tmp_path / "wan", local_files_only=True).state_dict()
    for name, p in exported.named_parameters():
        assert torch.equal(p, trained[name]), name
    assert any(not torch.equal(initial[n], trained[n]) for n in trained)


def test_pretrained_and_data_errors_name_the_fix(tmp_path):
    def cfg(model: dict, data: dict | None = None, train: dict | None = None):
        return Config.from_dict({"model": model, "data": data or {}, "train": train or {}})

    with pytest.raises(
        ValueError,
        match=r"pretrained = '.*nope' is not a directory; give a directory written by "
        r"save_pretrained",
    ):
        cfg({"pretrained": str(tmp_path / "nope")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config.json, so it is not a model directory; give"):
        cfg({"pretrained": str(tmp_path / "empty")})
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "model_index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is a diffusers pipeline: give its transformer folder"):
        cfg({"pretrained": str(pipe)})
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(
        ValueError,
        match=r"names neither a transformers \*ForCausalLM \(architectures = "
        r"\['BertModel'\]\)",
    ):
        cfg({"pretrained": str(tmp_path / "empty")})
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    lm = {"pretrained": str(tmp_path / "empty")}
    assert cfg(lm).model.family == "transformers"
    with pytest.raises(ValueError, match=r"remove architecture / \[model.config\]"):
        cfg({**lm, "architecture": "LlamaForCausalLM"})
    with pytest.raises(ValueError, match=r"family = 'diffusers' but .* holds a transformers model"):
        cfg({**lm, "family": "diffusers"})
    with pytest.raises(ValueError, match=r"format = 'latents' does not suit a transformers model"):
        cfg(lm, {"path": "x.jsonl", "format": "latents"})
    with pytest.raises(ValueError, match=r"eval_every = 5 needs an eval split: set \[data\] eval_fraction"):
        cfg(lm, {"path": "x.jsonl"}, {"eval_every": 5})
    with pytest.raises(ValueError, match=r"needs a tokenizer: train a \[model\] pretrained"):
        cfg({}, {"path": "x.jsonl"})
    with pytest.raises(ValueError, match=r"schedule = 'step' is not one of 'constant', 'cosine', 'linear'"):
        cfg(lm, None, {"schedule": "step"})


def test_lr_lambda_warmup_then_decay():
    from dcparallel.apps.train_setup import lr_lambda

    f = lr_lambda(2, 6, "cosine")
    assert [round(f(s), 6) for s in range(6)] == [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447]
    g = lr_lambda(0, 4, "linear")
    assert [g(s) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [lr_lambda(3, 10, "constant")(s) for s in (0, 2, 9)] == [1 / 3, 1.0, 1.0]


def test_a_finetune_resumed_after_a_crash_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """Same lr schedule, losses, eval losses and final weights whether the run crashed at
    step 5 and resumed from its step-4 checkpoint (in its second epoch) or ran straight through
    (world 1)."""

    def launch(root, fault: str = ""):
        config = tf.chat_run(root, world=1)
        config.write_text(
            config.read_text()
            .replace("epochs = 3", "epochs = 2\ncheckpoint_every = 2")
            .replace("tensorboard = true", "tensorboard = false")
        )
        monkeypatch.setenv("DCPARALLEL_FAULT", fault)
        return faults.run(Config.load(config))

    straight, crashed = tmp_path / "a", tmp_path / "b"
    straight.mkdir()
    crashed.mkdir()
    assert launch(straight) == 0
    with pytest.raises(RuntimeError, match="injected fault"):
        launch(crashed, "raise@5:0")
    assert launch(crashed) == 0
    rows = {}
    for root in (straight, crashed):
        rows[root] = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
        for r in rows[root]:
            r.pop("step_s"), r.pop("tokens_per_s"), r.pop("idle_fraction")
    assert len(rows[straight]) == 6 and rows[crashed] == rows[straight]
    a, b = (read_model(sorted((r / "run" / "checkpoint").glob("step_*"))[-1]) for r in (straight, crashed))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_clips_with_text_embeddings_of_different_lengths_are_refused_up_front(tmp_path):
    from types import SimpleNamespace

    from dcparallel.apps.train_setup import read_data

    pytest.importorskip("safetensors")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    tf.latents_manifest(a, [(1, 4, 4)], text_tokens=4)
    tf.latents_manifest(b, [(1, 4, 4)], text_tokens=6)
    manifest = tf.write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"latents": "a/lat0.safetensors", "text_embeddings": "a/txt0.safetensors"},
            {"latents": "b/lat0.safetensors", "text_embeddings": "b/txt0.safetensors"},
        ],
    )
    cfg = Config()
    cfg.model.family, cfg.data.path = "diffusers", str(manifest)
    model = SimpleNamespace(config=SimpleNamespace(in_channels=4, text_dim=16))
    with pytest.raises(
        ValueError,
        match=rf"different lengths \(4 tokens at {manifest}:1, 6 tokens at {manifest}:2\); "
        rf"pad them to one length",
    ):
        read_data(cfg, model, None, [])
