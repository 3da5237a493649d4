"""`dcparallel train` fine-tuning local pretrained models on real data under torchrun (2 gloo
ranks): a transformers Llama on a chat JSONL (warmup + cosine, clipping, eval split,
TensorBoard, export checked against the trained weights) and a diffusers Wan on a manifest
of latent files, logging to W&B offline as well."""

import json

import pytest
import torch

from dcparallel.runtime.sharded_checkpoint import read_model
from tests import train_fixtures as tf
from tests.support import torchrun_train

pytestmark = pytest.mark.e2e


def test_finetune_a_local_llama_on_chat_jsonl_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    config = tf.chat_run(tmp_path, world=2)
    r = torchrun_train(config, tmp_path, WANDB_SILENT="true")
    assert r.returncode == 0, r.stderr[-4000:]
    rows = tf.check_chat_run(tmp_path)
    assert all(r["world_size"] == 2 for r in rows)


def test_finetune_a_local_wan_on_a_latents_manifest_under_torchrun(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    pytest.importorskip("wandb")
    from diffusers import WanTransformer3DModel

    config = tf.wan_run(tmp_path, copies=4, tokens_per_step=80, schedule="cosine")
    r = torchrun_train(config, tmp_path, WANDB_SILENT="true")
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 4 and sum(r["loss"] for r in rows[-2:]) < sum(r["loss"] for r in rows[:2])
    assert rows[-1]["eval_loss"] is not None and any(r["grad_norm"] > 0.5 for r in rows)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0  # the W&B run, written offline
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [pytest.approx(r["loss"], rel=1e-6) for r in rows]
    exported = WanTransformer3DModel.from_pretrained(tmp_path / "run" / "final", local_files_only=True).eval()
    initial = WanTransformer3DModel.from_pretrained(tmp_path / "wan", local_files_only=True).eval()
    trained = WanTransformer3DModel.from_pretrained(tmp_path / "wan", local_files_only=True).eval()
    last = sorted((tmp_path / "run" / "checkpoint").glob("step_*"))[-1]
    missing, unexpected = trained.load_state_dict(read_model(last), strict=False)  # the engine's trained weights
    assert not unexpected and not set(missing) & set(dict(trained.named_parameters())), (missing, unexpected)
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 2, 4, 4, generator=g), torch.randn(1, 4, 16, generator=g)
    with torch.no_grad():
        a, b, c = (
            m(x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)[0]
            for m in (initial, exported, trained)
        )
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5)
