"""`dcparallel train` fine-tuning local pretrained models on real data under torchrun (2 gloo
ranks): a transformers Llama on a chat JSONL (warmup + cosine, clipping, eval split,
TensorBoard, export checked against the trained weights) and a diffusers Wan on a manifest
of latent files, logging to W&B offline as well.

Both runs share one torchrun launch (`runs`, `tests.torchrun_launch.train_each`: one process
group, `dcparallel train` on each config in turn, each run's exit status beside its
config). A launch and its ranks' imports (torch, transformers, diffusers) cost more
processor time than both trainings together."""

import json
from pathlib import Path

import pytest
import torch

from dcparallel.runtime.sharded_checkpoint import read_model
from tests import train_fixtures as tf
from tests.torchrun_launch import torchrun_train_each

pytestmark = pytest.mark.e2e


def _has(*modules: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


LLAMA_NEEDS, WAN_NEEDS = ("transformers", "tensorboard"), ("diffusers", "accelerate", "wandb", "tensorboard")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str, str]]:
    """The runs whose libraries are installed, trained in one torchrun launch: per run its
    folder, its exit status (or traceback) and the launch's stderr."""
    roots: dict[str, Path] = {}
    if _has(*LLAMA_NEEDS):
        roots["llama"] = tmp_path_factory.mktemp("llama")
        tf.chat_run(roots["llama"], world=2)
    if _has(*WAN_NEEDS):
        roots["wan"] = tmp_path_factory.mktemp("wan")
        tf.wan_run(roots["wan"], copies=4, tokens_per_step=80, schedule="cosine")
    if not roots:
        return {}
    configs = [root / "run.toml" for root in roots.values()]
    r = torchrun_train_each(configs, tmp_path_factory.getbasetemp(), WANDB_SILENT="true")
    return {name: (root, _status(root, r.returncode), r.stderr) for name, root in roots.items()}


def _status(root: Path, returncode: int) -> str:
    """ "0" when both ranks finished the run in ``root``, else what they wrote (or the launch's code)."""
    got = [(root / f"train_status_rank{rank}") for rank in (0, 1)]
    if not all(p.exists() for p in got):
        return f"not every rank finished (launch exit {returncode})"
    texts = {p.read_text() for p in got}
    return "0" if texts == {"0"} else "\n".join(texts)


def _run(runs: dict, name: str, needs: tuple[str, ...]) -> Path:
    for module in needs:
        pytest.importorskip(module)
    root, status, stderr = runs[name]
    assert status == "0", f"{status}\n{stderr[-4000:]}"
    return root


def test_finetune_a_local_llama_on_chat_jsonl_under_torchrun(runs):
    tmp_path = _run(runs, "llama", LLAMA_NEEDS)
    rows = tf.check_chat_run(tmp_path)
    assert all(r["world_size"] == 2 for r in rows)


def test_finetune_a_local_wan_on_a_latents_manifest_under_torchrun(runs):
    tmp_path = _run(runs, "wan", WAN_NEEDS)
    from diffusers import WanTransformer3DModel

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
