"""Exporting a trained model (`apps.train_checkpoint`, `dcparallel export`), in one process: a
gathered full state dict written through a copy of the model built on the meta device loads
with ``from_pretrained`` and holds exactly that state (transformers Llama, diffusers Wan);
`dcparallel export` of a run's committed checkpoint writes the weights the run exported at its
end, and refuses a config of another model. (Sharded runs: tests/e2e/test_sharded_train_torchrun.py.)"""

from __future__ import annotations

import pytest
import torch

from dcparallel.apps.train_checkpoint import write_export
from tests import train_fixtures as tf


def _perturbed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        k: v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in model.state_dict().items()
    }


@pytest.mark.parametrize("family", ["transformers", "diffusers"])
def test_a_gathered_state_dict_exports_through_a_meta_copy(tmp_path, family):
    if family == "transformers":
        pytest.importorskip("transformers")
        from transformers import LlamaForCausalLM as cls

        model = cls.from_pretrained(tf.llama_dir(tmp_path / "m", 64), local_files_only=True)
    else:
        pytest.importorskip("diffusers")
        pytest.importorskip("accelerate")
        from diffusers import WanTransformer3DModel as cls

        model = cls.from_pretrained(tf.wan_dir(tmp_path / "m"), local_files_only=True)
    state = _perturbed(model)
    write_export(family, model, tmp_path / "out", None, state)
    back = cls.from_pretrained(tmp_path / "out", local_files_only=True)
    got = back.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert not torch.equal(model.state_dict()[next(iter(state))], got[next(iter(state))])  # not the model's own


def test_dcparallel_export_of_a_checkpoint_equals_the_export_at_the_end(tmp_path):
    from safetensors.torch import load_file

    from dcparallel.apps.cli import main
    from dcparallel.apps.train import run
    from dcparallel.apps.train_config import Config

    config = tmp_path / "run.toml"
    text = f"""
[model]
num_layers = 2
hidden = 32
num_heads = 2
ffn_hidden = 64
[data]
num_samples = 20
[train]
tokens_per_step = 1500
max_steps = 3
out_dir = "{tmp_path / "run"}"
[profile]
cost = "analytic"
"""
    config.write_text(text)
    assert run(Config.load(config)) == 0
    end = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert main(["export", "--config", str(config), "--out", str(tmp_path / "exported")]) == 0
    again = load_file(tmp_path / "exported" / "model.safetensors")
    assert set(again) == set(end) and all(torch.equal(again[k], end[k]) for k in end)
    from dcparallel.apps.presets import build_model

    initial = build_model(Config.load(config).model, 0).state_dict()
    assert set(initial) == set(end) and any(not torch.equal(initial[k], end[k]) for k in end)  # trained

    config.write_text(text.replace("num_layers = 2", "num_layers = 3"))
    with pytest.raises(ValueError, match=r"written for another model: model.num_layers: checkpoint 2, now 3"):
        from dcparallel.apps.train_export import export_run

        export_run(config)
