"""Model adapters without a process group: what is read from each model family, and the
errors a model that lacks something gets (naming the missing piece and the fix)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dcparallel.adapters import find_adapter
from dcparallel.api import DataCentricParallel
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.heads import kv_heads_sent, kv_repeats
from dcparallel.models.attention import AttnPattern
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.spec import ClusterSpec, Layout, Recompute, h200_cluster, llama_like
from tests.adapter_models import TinyGQA, build


def test_transformers_llama_adapter_reads_gqa_and_exact_parameter_counts():
    pytest.importorskip("transformers")
    model = build("hf-llama")
    a = find_adapter(model)
    assert (a.num_heads, a.num_kv_heads, a.kind) == (8, 2, "text")
    assert a.spec.num_kv_heads == 2 and a.spec.kv_heads == 2 and a.spec.num_layers == 2
    assert a.spec.num_params == sum(p.numel() for p in model.parameters())
    assert a.attn_modules(a.blocks[0]) == [model.model.layers[0].self_attn]
    assert a.recompute_modes == ("none", "attn", "mlp", "full")


def test_wan_adapter_reads_latent_patch_rule():
    pytest.importorskip("diffusers")
    model = build("wan")
    a = find_adapter(model)
    assert a.kind == "video" and a.spec.attention == "full" and a.num_heads == 4
    # sizes are latent shapes: (frames, height, width) -> frames x (h/2) x (w/2) tokens
    assert a.spec.tokens((3, 4, 6)) == 3 * 2 * 3
    assert a.spec.num_params == sum(p.numel() for p in model.parameters())


def test_reference_factorized_dit_pairs_are_planner_layers():
    from dcparallel.models.dit import DiT, DiTConfig

    a = find_adapter(DiT(DiTConfig(num_layers=6, num_heads=4, hidden=32, freq_dim=16, attention="factorized")))
    assert a.blocks_per_layer == 2 and a.spec.num_layers == 3 and a.spec.attention == "factorized"
    assert [a.layer_of(i) for i in range(6)] == [0, 0, 1, 1, 2, 2]


class Bare(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)


def test_a_model_missing_the_protocol_gets_every_missing_piece_named():
    with pytest.raises(ValueError) as e:
        DataCentricParallel(Bare())
    msg = str(e.value)
    assert "cannot drive Bare" in msg
    assert "set_attention(fn)" in msg and "layers=" in msg and "num_heads=" in msg and "adapter=" in msg


def test_custom_model_with_explicit_heads_works_and_bad_kv_heads_are_refused():
    a = find_adapter(TinyGQA(), num_heads=4, num_kv_heads=2)
    assert (a.num_heads, a.num_kv_heads, len(a.blocks)) == (4, 2, 2) and a.spec.vocab_size == 96
    with pytest.raises(ValueError, match="4 query heads and 3 key/value heads: the key/value heads must divide"):
        find_adapter(TinyGQA(), num_heads=4, num_kv_heads=3)


def test_failed_construction_leaves_the_model_untouched_and_a_retry_works():
    model = Llama(LlamaConfig(num_layers=2))
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        DataCentricParallel(model, policy="fastest")
    with pytest.raises(ValueError, match="memory_bytes must be a positive"):
        DataCentricParallel(model, memory_bytes=-1)
    model.layers[0].attn_block.norm.weight.data = model.layers[0].attn_block.norm.weight.data.double()
    with pytest.raises(ValueError, match="mix dtypes"):
        DataCentricParallel(model)
    model.layers[0].attn_block.norm.weight.data = model.layers[0].attn_block.norm.weight.data.float()
    changed = "layers.0.attn_block.norm.weight"  # the one this test re-cast itself
    after = {n: p.data_ptr() for n, p in model.named_parameters() if n != changed}
    assert after == {n: v for n, v in before.items() if n != changed}  # nothing flattened into one buffer
    assert "forward" not in model.layers[0].__dict__  # no recompute wrapper installed
    dc = DataCentricParallel(model)  # the retry on the same object works
    assert dc.adapter.spec.num_layers == 2
    with pytest.raises(ValueError, match="already wrapped"):
        DataCentricParallel(model)


class OwnNames(TinyGQA):
    """A user model whose blocks call their sub-modules by other names (no attn_block /
    mlp_block): only whole blocks can be recomputed."""

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.attn, self.ff = TinyGQA.Attn(d, 4, 2), nn.Linear(d, d)

        def forward(self, x):
            return x + self.ff(x + self.attn(x))

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(OwnNames.Block(32) for _ in range(2))

    def set_attention(self, fn) -> None:
        for b in self.layers:
            b.attn.attention = fn


def test_selective_recompute_needs_sub_modules():
    from dcparallel.runtime.engine import Engine

    dc = Engine(OwnNames(), num_heads=4, num_kv_heads=2)
    assert dc.adapter.recompute_modes == ("none", "full")
    with pytest.raises(ValueError, match="expose no attn sub-module, so layer 0 cannot recompute attn alone.*full"):
        dc.recompute.set(Recompute(1, 0))
    dc.recompute.set(Recompute(2, 2))
    assert dc.recompute_modes() == ["full", "full"]


def test_gqa_kv_repeats_and_the_all_to_all_volume():
    assert [kv_repeats(2, sp) for sp in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert [kv_heads_sent(2, sp) for sp in (1, 2, 4, 8)] == [2, 2, 4, 8]
    assert kv_repeats(8, 4) == 1 and kv_heads_sent(8, 4) == 8
    # Llama-3-8B-like: 32 query heads, 8 kv heads move a quarter of the k, v bytes of MHA at SP 8
    mha = llama_like("mha", num_layers=2, hidden=4096, num_heads=32, ffn_hidden=14336, vocab_size=1000)
    gqa = llama_like("gqa", num_layers=2, hidden=4096, num_heads=32, ffn_hidden=14336, vocab_size=1000)
    import dataclasses

    gqa = dataclasses.replace(gqa, num_kv_heads=8)
    cluster = h200_cluster(8)
    t_mha = AnalyticCost(mha, cluster).terms([65536], 8).time_none
    t_gqa = AnalyticCost(gqa, cluster).terms([65536], 8).time_none
    t_mha1 = AnalyticCost(mha, cluster).terms([65536], 1).time_none
    t_gqa1 = AnalyticCost(gqa, cluster).terms([65536], 1).time_none
    assert t_gqa < t_mha and t_gqa1 == t_mha1  # only the all-to-alls differ


def test_transformers_attention_refuses_masks_dropout_and_long_windows():
    pytest.importorskip("transformers")
    from dcparallel.adapters.hf import hf_attention
    from dcparallel.runtime.ulysses import UlyssesAttention

    m = nn.Module()
    m.dcparallel_attention = UlyssesAttention()
    q = torch.randn(1, 4, 10, 8)
    kv = torch.randn(1, 2, 10, 8)
    out, w = hf_attention(m, q, kv, kv, None, scaling=8**-0.5)
    assert out.shape == (1, 10, 4, 8) and w is None
    with pytest.raises(ValueError, match="without attention_mask"):
        hf_attention(m, q, kv, kv, torch.ones(1, 1, 10, 10))
    m.train()
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        hf_attention(m, q, kv, kv, None, dropout=0.1)
    # a sliding window of 4 keys (key > query - 4, transformers' mask) shorter than the 10 tokens
    idx = torch.arange(10)
    band = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - 4)
    kv4 = kv.repeat_interleave(2, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, kv4, kv4, attn_mask=band).transpose(1, 2)
    assert torch.allclose(hf_attention(m, q, kv, kv, None, sliding_window=4)[0], want, atol=1e-6)
    # a non-default scale is applied: same as scaling q by hand
    out2, _ = hf_attention(m, q, kv, kv, None, scaling=0.5)
    ref, _ = hf_attention(m, q * (0.5 * 8**0.5), kv, kv, None)
    assert torch.allclose(out2, ref)


def test_grouped_kv_heads_at_sp1_equal_repeated_heads():
    from dcparallel.models.attention import sdpa_attention

    q, k, v = torch.randn(2, 12, 8, 4), torch.randn(2, 12, 2, 4), torch.randn(2, 12, 2, 4)
    for kind in ("causal", "full", "spatial", "temporal"):
        p = AttnPattern(kind, 3)
        a = sdpa_attention(q, k, v, p, (0, 5, 12) if kind == "causal" else None)
        b = sdpa_attention(
            q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2), p, (0, 5, 12) if kind == "causal" else None
        )
        assert torch.allclose(a, b, atol=1e-6), kind


def test_sp_degrees_follow_the_query_heads_with_grouped_kv_heads():
    """8 query heads over 2 key/value heads: SP 4 and 8 are allowed (kv heads repeated)."""
    from dcparallel.topology import group_sizes

    heads = find_adapter(TinyGQA(), num_heads=8, num_kv_heads=2).num_heads
    assert group_sizes(ClusterSpec(world_size=8, gpus_per_node=8), heads) == [1, 2, 4, 8]
    assert Layout(8, 1).sp == 8


@pytest.mark.parametrize("kind", ["hf-llama", "wan"])
def test_bf16_models_train_with_fp32_gradient_accumulation(kind):
    """bf16 parameters, fp32 loaded data, fp32 gradient buffer: the recipe users run."""
    pytest.importorskip("transformers" if kind.startswith("hf") else "diffusers")
    from dcparallel.data.collate import resolve_collate
    from dcparallel.plan.types import MicroBatch
    from dcparallel.runtime.engine import Engine
    from tests.adapter_models import item, make_data

    model = build(kind).to(torch.bfloat16)
    dc = Engine(model)
    data = make_data(kind, 2, 0)
    ids = (0,) if kind == "wan" else (0, 1)
    collate = dc.adapter.collate if callable(dc.adapter.collate) else resolve_collate(dc.adapter.collate, "text")
    batch = collate({s: item(data, s) for s in ids}, MicroBatch(ids, Layout(1, len(ids), Recompute(1, 2))), (0,), 0)
    with dc.micro_batch(batch) as ctx:
        ctx.backward(dc.adapter.loss_fn(model, batch, ctx))
    loss = dc.sync_gradients()
    assert dc.flat_grad.dtype == torch.float32 and torch.isfinite(dc.flat_grad).all() and loss > 0
    assert all(p.grad.dtype == torch.bfloat16 and p.grad.abs().sum() > 0 for p in dc.params[:4])


def test_prepare_profiles_and_trains_library_models_at_world_1(tmp_path):
    """`prepare` on one process (no torchrun): the transformers Llama and the diffusers Wan
    are profiled through their adapters, planned and trained; the loss falls."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    from tests.e2e.prepare_worker import run
    from tests.e2e.test_prepare_torchrun import check_runs

    check_runs({d["model"]: d for d in run(tmp_path)}, 1, tmp_path)


def test_heads_that_contradict_the_model_are_refused():
    with pytest.raises(ValueError, match="num_heads=3 but Llama has 4 attention heads"):
        DataCentricParallel(Llama(LlamaConfig(num_layers=2)), num_heads=3)
    with pytest.raises(ValueError, match="no repeated blocks"):
        DataCentricParallel(Llama(LlamaConfig(num_layers=2)), layers=[])
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="num_kv_heads=4 but the model's config has 2"):
        DataCentricParallel(build("hf-llama"), num_kv_heads=4)
