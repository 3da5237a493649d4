"""`DataCentricTrainer` under torchrun (2 gloo ranks): a transformers Trainer script switched
by its `# dcparallel` lines fine-tunes a local Llama on chat JSONL with completion-only labels
(`hf_trainer_worker.py`). Its per-step losses and final weights equal dcparallel's own loop
on the same planned steps (same AdamW, linear warmup schedule, clipping), and so do those of
`DataCentricSFTTrainer` on the raw chats (TRL's formatting, assistant-only loss); its
evaluation equals the plain Trainer's on the unmodified model, a resume from the step-2
checkpoint ends at the same weights, and report_to="tensorboard" writes event files. A PEFT
LoRA model trained by the Trainer is saved by ``trainer.save_model`` as an adapter folder that
``PeftModel.from_pretrained`` loads with the trained adapter weights."""

import pytest
import torch
from safetensors.torch import load_file

from tests import train_fixtures as tf
from tests.support import ROOT, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_trainer_equals_dcparallel_loop_evaluates_resumes_and_logs(tmp_path):
    pytest.importorskip("tensorboard")
    model = tf.llama_dir(tmp_path / "model", len(tf.tokenizer()))
    chat = tf.write_jsonl(tmp_path / "chat.jsonl", tf.conversations(40, seed=0))
    r = torchrun(
        [str(ROOT / "tests" / "e2e" / "hf_trainer_worker.py"), str(model), str(chat), str(tmp_path / "out")], tmp_path
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = torch.load(tmp_path / "out" / "result.pt", weights_only=False)
    trainer, loop, resumed = res["trainer"], res["loop"], res["resumed"]
    assert res["world"] == 2
    # the Trainer's loss is the engine's fp64 step mean rounded to fp32: equal to fp32 precision
    assert len(trainer["losses"]) == len(loop["losses"]) == 4
    assert trainer["losses"] == pytest.approx(loop["losses"], rel=1e-6)
    assert trainer["losses"][-1] < trainer["losses"][0]  # it learns
    assert trainer["weights"].keys() == loop["weights"].keys()
    initial = load_file(model / "model.safetensors")
    for name, w in loop["weights"].items():
        assert _rel(trainer["weights"][name], w) <= 1e-5, name
        assert _rel(resumed["weights"][name], w) <= 1e-5, name
        assert _rel(res["sft"]["weights"][name], w) <= 1e-5, name
        assert _rel(w, initial[name]) > 1e-4, name  # trained
    assert res["sft"]["losses"] == pytest.approx(loop["losses"], rel=1e-6)
    assert resumed["losses"] == pytest.approx(trainer["losses"][2:], rel=1e-6)
    evals = [row for row in trainer["log"] if "eval_loss" in row]
    assert [row["step"] for row in evals] == [2, 4, 4]  # eval_steps=2, then trainer.evaluate()
    assert trainer["eval_loss"] == pytest.approx(res["plain_eval"], rel=1e-5)
    assert sorted((tmp_path / "out" / "trainer").glob("checkpoint-*/dc_state/__1_0.distcp"))  # the one format
    assert list((tmp_path / "out" / "trainer" / "runs").rglob("events.out.tfevents.*"))
    # the LoRA run's adapter export loads with PEFT and holds the trained adapters
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export = tmp_path / "out" / "lora_export"
    assert (export / "adapter_config.json").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, local_files_only=True), export)
    got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    trained_lora = {n: w for n, w in res["lora"]["weights"].items() if "lora_" in n}
    assert trained_lora and len(got) == len(trained_lora)
    for name, w in trained_lora.items():
        key = next(k for k in got if k.replace(".default", "") == name.replace(".default", ""))
        assert _rel(got[key], w) <= 1e-6, name
    assert any(_rel(w, torch.zeros_like(w)) > 0 for n, w in trained_lora.items() if "lora_B" in n)  # trained
