"""`dcparallel train` fine-tuning a local Qwen2.5-VL on a chat-with-images JSONL under torchrun
(2 gloo ranks): built from a config and saved with its processor (tokenizer, chat template,
image processor), images drawn at three sizes. The run stops after 4 steps and a second
launch resumes it; the loss falls, the eval split is evaluated, and the export loads with
``from_pretrained`` (model, tokenizer, image processor), holds the trained weights (the
vision tower's too) and generates; `dcparallel export` of the last checkpoint writes the same."""

import json
from pathlib import Path

import pytest
import torch

from dcparallel.runtime.sharded_checkpoint import read_model
from tests import train_fixtures as tf
from tests import vlm_train_fixtures as vf
from tests.support import torchrun_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # two launches: about 90 s on a loaded 2-core machine


def _config(root: Path, max_steps: int) -> Path:
    return tf.write_config(
        root / "run.toml",
        model={"pretrained": root / "model"},
        data={"path": root / "chat.jsonl", "eval_fraction": 0.125},
        train={
            "tokens_per_step": 400,
            "epochs": 4,
            "max_steps": max_steps,
            "lr": 0.01,
            "eval_every": 2,
            "checkpoint_every": 2,
            "out_dir": root / "run",
        },
        profile={"cost": "analytic"},
    )


def _generate(folder: Path, image: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The export's greedy answer to "what color is this" about ``image``: (prompt, output)."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    pixels = AutoImageProcessor.from_pretrained(folder, local_files_only=True)(
        images=[Image.open(image).convert("RGB")], return_tensors="pt"
    )
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image.name}, {"type": "text", "text": "what color is this"}],
        }
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    n = int(pixels["image_grid_thw"].prod()) // 4  # placeholders: patches / merge^2
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), add_special_tokens=False, return_tensors="pt")[
        "input_ids"
    ]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
        )
    return ids, out


def test_finetune_a_local_qwen25_vl_on_chats_with_images_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("PIL")
    from transformers import AutoModelForImageTextToText

    vf.qwen25_vl_dir(tmp_path / "model")
    vf.write_jsonl(tmp_path / "chat.jsonl", vf.chats(tmp_path, 32))
    r = torchrun_train(_config(tmp_path, max_steps=4), tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    run = tmp_path / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
    r = torchrun_train(_config(tmp_path, max_steps=0), tmp_path)  # the rest of the run, resumed at step 4
    assert r.returncode == 0, r.stderr[-4000:]

    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [4]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    n = len(rows)
    assert n >= 10 and [r["global_step"] for r in rows] == list(range(1, n + 1))  # each step once
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    evals = {r["global_step"]: r["eval_loss"] for r in rows if r["eval_loss"] is not None}
    assert set(evals) == {s for s in range(1, n + 1) if s % 2 == 0 or s == n}
    assert evals[n] < evals[2], evals

    final = run / "final"
    assert {"preprocessor_config.json", "chat_template.jinja", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    initial = AutoModelForImageTextToText.from_pretrained(tmp_path / "model", local_files_only=True)
    exported = AutoModelForImageTextToText.from_pretrained(final, local_files_only=True)
    last = sorted((run / "checkpoint").glob("step_*"))[-1]
    trained = read_model(last)  # the engine's trained weights at the end
    params = dict(exported.named_parameters())
    assert set(trained) == set(params)
    for name, value in trained.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0)
    start = dict(initial.named_parameters())
    moved = {name for name, p in params.items() if not torch.equal(p, start[name])}
    assert any(".visual.blocks." in name for name in moved) and any("language_model" in name for name in moved)

    ids, out = _generate(final, tmp_path / "img" / "0_0.png")
    assert out.shape[1] > ids.shape[1] and torch.equal(out[0, : ids.shape[1]], ids[0])

    from dcparallel.apps.train_export import export_run

    again = export_run(tmp_path / "run.toml", out=tmp_path / "exported")
    assert {p.name for p in again.iterdir()} == {p.name for p in final.iterdir()}
    reloaded = dict(AutoModelForImageTextToText.from_pretrained(again, local_files_only=True).named_parameters())
    assert all(torch.equal(reloaded[n], p) for n, p in params.items())
