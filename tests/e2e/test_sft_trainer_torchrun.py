"""`DataCentricSFTTrainer` under torchrun (2 gloo ranks): a TRL `SFTTrainer` script switched
by its `# dcparallel` lines fine-tunes a local Llama on conversational prompt-completion rows
with TRL's completion-only loss (`sft_trainer_worker.py`). Its per-step losses and final
weights equal dcparallel's own loop on labels masked here from the chat template; its
evaluation equals the unmodified SFTTrainer's on the same weights; a resume from the step-2
checkpoint ends at the same weights, at 2 ranks and in 1 process (the optimizer shards
reshard); report_to="tensorboard" writes the logged losses; a ``peft_config`` LoRA run's
``trainer.save_model`` folder loads with ``PeftModel.from_pretrained`` holding the trained
adapters."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests import train_fixtures as tf
from tests.support import ROOT, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_sft_trainer_equals_loop_evaluates_resumes_logs_and_exports(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("tensorboard")
    from peft import PeftModel
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    model = tf.llama_dir(tmp_path / "model", len(tf.tokenizer()))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = torchrun([str(ROOT / "tests" / "e2e" / "sft_trainer_worker.py"), str(model), str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    res = torch.load(tmp_path / "out" / "result.pt", weights_only=False)
    sft, loop, resumed = res["sft"], res["loop"], res["resumed"]
    assert res["world"] == 2
    # completion-only: the loss is the engine's fp64 mean over the completions' targets
    assert len(sft["losses"]) == len(loop["losses"]) == 4
    assert sft["losses"] == pytest.approx(loop["losses"], rel=1e-6)
    # steps 1-2 from the checkpoint's log history, 3-4 trained after the resume
    assert resumed["losses"] == pytest.approx(sft["losses"], rel=1e-6)
    assert sft["losses"][-1] < sft["losses"][0]  # it learns
    initial = load_file(model / "model.safetensors")
    assert sft["weights"].keys() == loop["weights"].keys() == resumed["weights"].keys()
    for name, w in loop["weights"].items():
        assert _rel(sft["weights"][name], w) <= 1e-5, name
        assert _rel(resumed["weights"][name], w) <= 1e-5, name
        assert _rel(w, initial[name]) > 1e-4, name  # trained
    evals = [row for row in sft["log"] if "eval_loss" in row]
    assert [row["step"] for row in evals] == [2, 4, 4]  # eval_steps=2, then trainer.evaluate()
    assert sft["eval_loss"] == pytest.approx(res["plain_eval"], rel=1e-5)
    out = tmp_path / "out" / "sft"
    assert {p.name for p in (out / "checkpoint-2").iterdir()} >= {
        "dc_state",  # the one checkpoint format (torch.distributed.checkpoint)
        "scheduler.pt",
        "trainer_state.json",
    }
    # the step-2 checkpoint of 2 ranks resumed by 1 process (no torchrun): the same weights
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "e2e" / "sft_trainer_worker.py"),
            str(model),
            str(tmp_path / "one"),
            str(out / "checkpoint-2"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    one = torch.load(tmp_path / "one" / "result.pt", weights_only=False)
    assert one["world"] == 1 and one["resumed"]["losses"] == pytest.approx(sft["losses"], rel=1e-6)
    for name, w in loop["weights"].items():
        assert _rel(one["resumed"]["weights"][name], w) <= 1e-5, name
    runs = []  # one events folder per run: the first run's steps 1-4, the resumed run's 3-4
    for folder in sorted({p.parent for p in (out / "runs").rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(folder))
        acc.Reload()
        runs.append([(e.step, e.value) for e in acc.Scalars("train/loss")])
    first, second = sorted(runs, key=len, reverse=True)
    assert [s for s, _ in first] == [1, 2, 3, 4] and [s for s, _ in second] == [3, 4]
    assert [v for _, v in first + second] == pytest.approx(sft["losses"] + sft["losses"][2:], rel=1e-6)
    # the LoRA run's adapter export loads with PEFT and holds the trained adapters
    export = tmp_path / "out" / "lora_export"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, local_files_only=True), export)
    got = {n.replace(".default", ""): p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    trained = {n.replace(".default", ""): w for n, w in res["lora"]["weights"].items()}
    assert trained and trained.keys() == got.keys()
    for name, w in trained.items():
        assert _rel(got[name], w) <= 1e-6, name
    assert any(float(w.abs().max()) > 0 for n, w in trained.items() if "lora_B" in n)  # trained
