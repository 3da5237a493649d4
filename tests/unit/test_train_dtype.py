"""`dcparallel train` builds every model kind in bfloat16 on GPUs, refuses float16, and the
engine warns about float32 parameters on a GPU.

The GPU is the device decision (`train_setup.on_gpu`) answering yes for the meta device:
models are built on meta, so no CUDA is needed and no weights are materialized."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from dcparallel.apps import train_setup
from dcparallel.apps.train_config import Config
from dcparallel.runtime import engine
from tests.train_fixtures import WAN_CONFIG, llama_dir, wan_dir

LLAMA_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def model_kinds(tmp_path) -> dict[str, dict]:
    return {
        "reference": {},
        "transformers config": {"family": "transformers", "architecture": "LlamaForCausalLM", "config": LLAMA_CONFIG},
        "diffusers config": {"family": "diffusers", "architecture": "WanTransformer3DModel", "config": WAN_CONFIG},
        "transformers pretrained": {"pretrained": str(llama_dir(tmp_path / "llama", vocab_size=64))},
        "diffusers pretrained": {"pretrained": str(wan_dir(tmp_path / "wan"))},
    }


@pytest.fixture
def gpu(monkeypatch):
    """The meta device stands for a GPU; the matmul precision is restored afterwards."""
    monkeypatch.setattr(train_setup, "on_gpu", lambda device: device.type == "meta")
    precision = torch.get_float32_matmul_precision()
    yield torch.device("meta")
    torch.set_float32_matmul_precision(precision)


def test_every_model_train_builds_is_bfloat16_on_a_gpu_by_default(tmp_path, gpu):
    for kind, model in model_kinds(tmp_path).items():
        built, _ = train_setup.load_model(Config.from_dict({"model": model}), gpu)
        assert {p.dtype for p in built.parameters()} == {torch.bfloat16}, kind
        # RoPE frequencies (transformers' inv_freq, Wan's freqs_cos / freqs_sin) stay fp32
        assert {b.dtype for b in built.buffers() if b.is_floating_point()} <= {torch.float32}, kind
        assert {p.device.type for p in built.parameters()} == {"meta"}, kind


def test_float32_stays_where_asked_with_tf32_matmuls_on_a_gpu(gpu):
    torch.set_float32_matmul_precision("highest")
    built, _ = train_setup.load_model(Config.from_dict({"train": {"dtype": "float32"}}), gpu)
    assert {p.dtype for p in built.parameters()} == {torch.float32}
    assert torch.get_float32_matmul_precision() == "high"


def test_the_cpu_default_stays_float32():
    assert train_setup.param_dtype(Config.from_dict({}), torch.device("cpu")) == torch.float32


def test_float16_is_refused_with_the_fix():
    with pytest.raises(
        ValueError,
        match=r'\[train\] dtype = "float16" is not supported: the loss is a sum over '
        r'tokens with no loss scaling.*use "bfloat16"',
    ):
        train_setup.load_model(Config.from_dict({"train": {"dtype": "float16"}}), torch.device("cpu"))


def test_the_engine_warns_once_about_float32_parameters_on_a_gpu(monkeypatch):
    monkeypatch.setattr(engine, "_warned_fp32_cuda", False)
    cuda = torch.device("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.warn_fp32_cuda([SimpleNamespace(device=cuda, dtype=torch.bfloat16)])
        engine.warn_fp32_cuda([SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)])
        assert caught == []
        for _ in range(2):
            engine.warn_fp32_cuda([SimpleNamespace(device=cuda, dtype=torch.float32)])
    assert len(caught) == 1 and "float32 on CUDA" in str(caught[0].message)
    assert "model.to(torch.bfloat16)" in str(caught[0].message)
