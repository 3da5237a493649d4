"""transformers families with attention beyond a plain causal softmax, without a process
group: what the adapter reads (MLA head sizes, priced by the cost model) and sliding windows
over documents longer than them. Their gradient parity is tests/dist/test_dist_hf_families."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dcparallel.adapters import find_adapter
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.heads import a2a_hidden_units, kv_heads_sent
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from dcparallel.spec import Layout, h200_cluster, llama_like
from tests import hf_families

pytest.importorskip("transformers")


def test_deepseek_v3_spec_knows_the_value_head_size_and_the_cost_model_prices_it():
    spec = find_adapter(hf_families.build("hf-deepseek-v3")).spec
    assert (spec.num_heads, spec.kv_heads, spec.head_dim, spec.v_head_dim) == (4, 4, 12, 6)
    # q, k at 12 values per head to head sharding, v at 6, the output (6 per head) back
    assert a2a_hidden_units(spec, 2) == (4 * 12 + 4 * 12 + 4 * 6 + 4 * 6) / 32
    wide_v = dataclasses.replace(spec, v_head_dim=12)
    cluster = h200_cluster(8)
    t = lambda s, sp: AnalyticCost(s, cluster).terms([4096], sp).time_none
    assert t(spec, 2) < t(wide_v, 2) and t(spec, 1) == t(wide_v, 1)  # only the all-to-alls differ


def test_models_of_hidden_sized_heads_are_priced_as_before():
    llama = llama_like("l", num_layers=2, hidden=4096, num_heads=32, ffn_hidden=11008, vocab_size=32000)
    for kv, sp in ((32, 4), (8, 4), (2, 8)):
        m = dataclasses.replace(llama, num_kv_heads=kv)
        assert a2a_hidden_units(m, sp) == 2 + 2 * kv_heads_sent(kv, sp) / 32  # exactly: the same plans


@pytest.mark.parametrize("kind", ["hf-gemma2", "hf-gpt-oss"])
def test_documents_longer_than_a_sliding_window_match_transformers(kind):
    """Packed documents of 40 and 9 tokens under a window of 16 keys: the logits through
    dcparallel's attention (window and document boundaries in the kernel) equal the model's
    own eager attention on each document alone, to fp32 rounding; without the window they
    would move by far more."""
    from dcparallel.data.collate import resolve_collate

    model = hf_families.build(kind)
    model.config.sliding_window = 16
    for layer in model.model.layers:  # the layers read the window when built
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 16
    docs = [torch.randint(0, hf_families.VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 9)]
    with torch.no_grad():
        ref = torch.cat([model(input_ids=d[None], use_cache=False).logits for d in docs], dim=1)
    dc = Engine(model)
    batch = resolve_collate("text", "text")(dict(enumerate(docs)), MicroBatch((0, 1), Layout(1, 1)), (0,), 0)
    with torch.no_grad(), dc.micro_batch(batch):
        out = model(input_ids=batch.inputs, position_ids=batch.positions, use_cache=False).logits
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        unwindowed = model(input_ids=batch.inputs, position_ids=batch.positions, use_cache=False).logits
    err = lambda a: ((a - ref).abs().max() / ref.abs().max()).item()
    assert err(out) <= 1e-5 and err(unwindowed) > 1e-3
