"""A model larger than one device, on gloo at world 2 with shard_size 2 (`runtime.meta_init`):
built on the meta device under `dcparallel.empty_init`, wrapped (FSDP2 per block, then storage
for this rank's shards only) and loaded shard by shard from a ``save_pretrained`` folder.

- Memory: the peak live CPU bytes per rank during build + wrap + load (each storage once) stay
  within (bf16 model)/s + one block (bf16) + the fp32 parameter shard — the gradient shards
  get storage at the first micro-batch, the computed buffers are kept, not copied — a bound
  derived from the model's real sizes, which the whole-model recipe (the model built on CPU,
  then wrapped) exceeds.
- Exactness: the buffers the constructor computes (rotary ``inv_freq``, in no checkpoint) are
  bit-equal to the CPU model's, and the loss and every gradient of a step equal a single
  process running the unmodified CPU model that was saved (fp32; sharding reorders sums: a
  few fp32 roundings, measured below 3e-6 relative; a wrong or missing shard moves them by
  far more than 1e-5).
- Refusals: a meta model with shard_size 1, buffers lost on meta, a step before
  `load_weights`, a checkpoint of another model."""

from __future__ import annotations

import pytest
import torch

from tests import adapter_models, support
from tests.dist import meta_cases
from tests.dist.harness import Workers
from tests.support import rel_err

pytestmark = pytest.mark.dist

SEEDS, NUM_SAMPLES = [31, 32], 5


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    pytest.importorskip("transformers")
    w = Workers(2, tmp_path_factory.mktemp("rdv-meta"))
    yield w
    w.close()


def _saved(tmp_path, kind: str, dtype: torch.dtype) -> str:
    folder = tmp_path / f"{kind}-{dtype}".replace("torch.", "")
    folder.mkdir()
    meta_cases.save(kind, str(folder), dtype)
    return str(folder)


def _bound(model: torch.nn.Module, blocks, s: int) -> int:
    """Issue 51's bound on a rank of a block of ``s``, for ``model`` in the dtype it is saved and
    loaded in (bf16 here): ``whole / s + block + shard32``, with

    - ``whole``: every parameter's bytes in that dtype (the model a rank must never hold);
    - ``block``: the largest of ``blocks`` in that dtype (room for what is in transit: the
      loader holds one parameter's slice at a time, and no parameter outgrows its block);
    - ``shard32``: this rank's fp32 parameter shards, 4 P / s (FSDP2 pads each parameter's
      dim 0 to a multiple of s; the models here have even dims, so no padding).

    Nothing for gradients: their shards get storage at the first micro-batch, after the load."""
    params = list(model.parameters())
    whole = sum(p.numel() * p.element_size() for p in params)
    shard32 = sum(-(-p.shape[0] // s) * (p.numel() // max(1, p.shape[0])) * 4 for p in params)
    assert shard32 == 4 * sum(p.numel() for p in params) // s  # no padding: exactly 4 P / s
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)
    return whole // s + block + shard32


@pytest.mark.parametrize("kind", ["hf-llama", "llama"])
def test_meta_model_loads_within_a_shard_of_memory(workers, tmp_path, kind):
    folder = _saved(tmp_path, kind, torch.bfloat16)
    cpu = meta_cases.build(kind, meta=False, dtype=torch.bfloat16)
    blocks = cpu.layers if kind == "llama" else cpu.model.layers
    bound = _bound(cpu, blocks, 2)
    whole32 = sum(p.numel() * 4 for p in cpu.parameters())
    meta = workers.run(meta_cases.case_wrap_and_load, kind, folder, "bfloat16", True)
    whole = workers.run(meta_cases.case_wrap_and_load, kind, folder, "bfloat16", False)
    for r in range(2):
        assert meta[r]["param_dtypes"] == ["torch.float32"]  # fp32 master shards of the bf16 model
        assert meta[r]["peak"] <= bound, (r, meta[r]["peak"], bound, whole32)
        # the bound tells the two recipes apart: the whole model on one rank exceeds it
        assert whole[r]["peak"] > bound, (r, whole[r]["peak"], bound)
    print(
        f"{kind}: peak {[m['peak'] for m in meta]} B per rank (whole-model recipe "
        f"{[w['peak'] for w in whole]}), bound {bound}, whole fp32 model {whole32}"
    )


def _reference(kind: str, model: torch.nn.Module, seed: int):
    if kind != "hf-llama":
        return support.reference(model, support.make_data(kind, NUM_SAMPLES, seed), list(range(NUM_SAMPLES)))
    return adapter_models.reference(model, adapter_models.make_data(kind, NUM_SAMPLES, seed), range(NUM_SAMPLES))


@pytest.mark.parametrize("kind", ["hf-llama", "llama", "llama-tied"])
def test_meta_model_step_matches_the_saved_model(workers, tmp_path, kind):
    folder = _saved(tmp_path, kind, torch.float32)
    cpu = meta_cases.build(kind, meta=False)
    out = workers.run(meta_cases.case_meta_parity, kind, folder, SEEDS, NUM_SAMPLES)
    for r in range(2):
        bufs = dict(cpu.named_buffers())
        assert set(out[r]["buffers"]) == set(bufs)
        for n, b in bufs.items():
            assert torch.equal(out[r]["buffers"][n], b), (r, n)
    if kind == "hf-llama":
        assert "model.rotary_emb.inv_freq" in bufs
    tied = sorted(
        n
        for n, p in cpu.named_parameters(remove_duplicate=False)
        if any(q is p and m != n for m, q in cpu.named_parameters(remove_duplicate=False))
    )
    assert out[0]["tied"] == tied and (kind != "llama-tied" or tied)  # the tie survives materializing
    for i, seed in enumerate(SEEDS):
        ref_loss, ref_grads = _reference(kind, cpu, seed)
        for r in range(2):
            step = out[r]["steps"][i]
            assert abs(step["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (r, seed, step["loss"], ref_loss)
            assert set(step["grads"]) == set(ref_grads)
            for name, g in step["grads"].items():
                assert rel_err(g, ref_grads[name]) <= 1e-5, (kind, r, seed, name)


def test_meta_refusals(workers, tmp_path):
    folder = _saved(tmp_path, "hf-llama", torch.float32)
    msgs = workers.run(meta_cases.case_refusals, folder)[0]
    assert "shard_size=1" in msgs["shard1"] and "shard_size=2" in msgs["shard1"]
    assert "inv_freq" in msgs["meta_buffers"] and "empty_init" in msgs["meta_buffers"]
    assert "load_weights" in msgs["unloaded"]
    assert "missing" in msgs["mismatch"] and "unexpected" in msgs["mismatch"]


def test_the_api_wraps_a_meta_model_and_loads_it(workers, tmp_path):
    folder = _saved(tmp_path, "hf-llama", torch.float32)
    cpu = meta_cases.build("hf-llama", meta=False)
    out = workers.run(meta_cases.case_api_load, folder)
    for r in range(2):
        assert out[r]["device"] == "cpu"  # the launch's device, not meta
        assert set(out[r]["params"]) == {n for n, _ in cpu.named_parameters()}
        for n, p in cpu.named_parameters():
            assert torch.equal(out[r]["params"][n], p), (r, n)
