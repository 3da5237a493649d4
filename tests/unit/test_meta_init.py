"""Models built without their weights (`runtime.meta_init`), one process, no sharding: what
`dcparallel train` builds from a pretrained folder with shard_size > 1 is on the meta device
with its computed buffers exact, and `materialize` + `load_weights` give back exactly the
model ``from_pretrained`` loads (one file, an index of several, tied embeddings, a diffusers
transformer). Sharded loading and its memory: tests/dist/test_dist_meta_init.py."""

from __future__ import annotations

import pytest
import torch

from dcparallel.apps.train_config import Config
from dcparallel.apps.train_setup import load_model
from dcparallel.runtime.meta_init import load_weights, materialize
from tests import train_fixtures as tf

CPU = torch.device("cpu")


def _cfg(folder, shard_size=2, dtype="auto") -> Config:
    return Config.from_dict({"model": {"pretrained": str(folder)}, "train": {"shard_size": shard_size, "dtype": dtype}})


def _loaded_exactly(model, reference) -> None:
    assert not any(p.device.type == "meta" for p in model.parameters())
    ref = dict(reference.state_dict())
    got = dict(model.state_dict())
    assert set(got) == set(ref)
    for n, t in ref.items():
        assert torch.equal(got[n], t), n
    for (n, b), (_, rb) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(b, rb), n  # non-persistent ones (inv_freq) too


@pytest.mark.parametrize("tied,shard_kb", [(False, None), (True, None), (False, 20)])
def test_pretrained_llama_built_on_meta_then_loaded_equals_from_pretrained(tmp_path, tied, shard_kb):
    transformers = pytest.importorskip("transformers")
    tf.llama_dir(tmp_path / "m", len(tf.tokenizer()))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    if tied or shard_kb:  # re-saved tied, or as several files with an index
        ref.config.tie_word_embeddings = tied
        ref.tie_weights()
        ref.save_pretrained(tmp_path / "m", max_shard_size=f"{shard_kb}KB" if shard_kb else "5GB")
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    if shard_kb:
        assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    model, tok = load_model(_cfg(tmp_path / "m"), CPU)
    assert tok is not None
    assert all(p.device.type == "meta" for p in model.parameters())
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert materialize(model, CPU) == []
    load_weights(model, tmp_path / "m")
    _loaded_exactly(model, ref)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_shard_size_1_and_auto_load_whole(tmp_path):
    pytest.importorskip("transformers")
    tf.llama_dir(tmp_path / "m", len(tf.tokenizer()))
    for s in (1, "auto"):
        model, _ = load_model(_cfg(tmp_path / "m", s), CPU)
        assert all(p.device.type == "cpu" for p in model.parameters()), s


def test_pretrained_wan_built_on_meta_then_loaded_equals_from_pretrained(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    tf.wan_dir(tmp_path / "w")
    ref = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "w", local_files_only=True)
    model, _ = load_model(_cfg(tmp_path / "w"), CPU)
    assert all(p.device.type == "meta" for p in model.parameters())
    materialize(model, CPU)
    load_weights(model, tmp_path / "w")
    _loaded_exactly(model, ref)
    # Wan keeps some modules in fp32 when loaded in bf16; the engine trains one dtype, so the
    # meta build casts every parameter as the whole-model path does (`cast_parameters`)
    bf16, _ = load_model(_cfg(tmp_path / "w", dtype="bfloat16"), CPU)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}


def test_load_weights_refuses_a_folder_without_safetensors(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_weights(model, tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        load_weights(model, tmp_path / "nope")


def test_load_weights_at_shard_size_1_before_the_optimizer_only(tmp_path):
    from safetensors.torch import save_model

    from dcparallel.runtime.engine import Engine
    from tests import support

    saved = support.make_model("llama", seed=1).to(torch.bfloat16)
    save_model(saved, str(tmp_path / "model.safetensors"))
    model = support.make_model("llama", seed=2).to(torch.bfloat16)
    dc = Engine(model, layers=model.layers, num_heads=support.NUM_HEADS)
    dc.load_weights(tmp_path)  # into the flat buffer's views
    for n, p in model.named_parameters():
        assert torch.equal(p, saved.get_parameter(n)), n
    dc.optimizer()  # its fp32 masters are copies: a later load would be undone by the first step
    with pytest.raises(ValueError, match="before dc.optimizer"):
        dc.load_weights(tmp_path)
