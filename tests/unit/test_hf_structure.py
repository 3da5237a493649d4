"""transformers causal LMs read from their own structure (no process group): blocks,
attention and MLP sub-modules of families whose layers live elsewhere, the overrides, the
families that must be refused (each message names the model, the layer, the module, why
and the fix), the per-document limit of chunked attention, and the engine's proof that
every block calls the attention it installed. World-1 parity of the supported families
with packed documents: `test_supported_families_at_world_1`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dcparallel.adapters import find_adapter
from dcparallel.data.collate import resolve_collate
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from dcparallel.spec import Layout, Recompute
from tests.adapter_models import TinyGQA
from tests.hf_structure_families import REFUSED, build, make_data, reference, refused, tiny
from tests.support import rel_err

pytest.importorskip("transformers")
torch.set_num_threads(1)


def run_packed(model: nn.Module, data, ids, rc: Recompute, **engine_kw) -> tuple[Engine, float]:
    """One micro-batch of the documents ``ids`` packed into one row, at SP 1."""
    dc = Engine(model, **engine_kw)
    collate = resolve_collate(dc.adapter.collate, dc.adapter.kind)
    batch = collate({s: data.docs[s] for s in ids}, MicroBatch(tuple(ids), Layout(1, len(ids), rc)), (0,), 0)
    with dc.micro_batch(batch) as ctx:
        ctx.backward(dc.adapter.loss_fn(model, batch, ctx))
    return dc, dc.sync_gradients()


def test_gpt_neox_blocks_attention_and_mlp_are_found_and_layers_override_works():
    model = build("gpt_neox")
    a = find_adapter(model)
    assert a.blocks == list(model.gpt_neox.layers)
    assert a.attn_modules(a.blocks[1]) == [model.gpt_neox.layers[1].attention]
    assert a.mlp_modules(a.blocks[1]) == [model.gpt_neox.layers[1].mlp]
    assert a.recompute_modes == ("none", "attn", "mlp", "full") and a.spec.ffn_hidden == 96
    assert a.spec.num_params == sum(p.numel() for p in model.parameters())
    b = find_adapter(model, layers=model.gpt_neox.layers[:2], mlp_modules=lambda blk: [blk.mlp.dense_h_to_4h])
    assert b.blocks == a.blocks and b.mlp_modules(b.blocks[0]) == [model.gpt_neox.layers[0].mlp.dense_h_to_4h]
    with pytest.raises(
        ValueError,
        match=r"attn_modules returned \['GPTNeoXMLP'\] for layer 0 .*"
        r"ALL_ATTENTION_FUNCTIONS",
    ):
        find_adapter(model, attn_modules=lambda blk: [blk.mlp])


def test_moe_blocks_under_other_names_are_found():
    g = find_adapter(build("granitemoe"))
    assert [type(m).__name__ for m in g.mlp_modules(g.blocks[0])] == ["GraniteMoeMoE"]
    ll = find_adapter(build("llama4_text"))
    assert [type(m).__name__ for m in ll.mlp_modules(ll.blocks[0])] == ["Llama4TextMoe"]
    assert ll.spec.num_params == sum(p.numel() for p in build("llama4_text").parameters())


@pytest.mark.parametrize("kind", list(REFUSED))
def test_token_mixing_outside_attention_is_refused_by_name(kind):
    with pytest.raises(ValueError) as e:
        find_adapter(refused(kind))
    missing = [w for w in REFUSED[kind][1] if w not in str(e.value)]
    assert not missing, (missing, str(e.value))


def test_a_forward_without_position_ids_is_refused():
    from transformers import BartConfig, BartForCausalLM

    cfg = BartConfig(
        vocab_size=96,
        d_model=32,
        decoder_layers=1,
        encoder_layers=1,
        decoder_attention_heads=4,
        encoder_attention_heads=4,
        decoder_ffn_dim=32,
        encoder_ffn_dim=32,
    )
    with torch.device("meta"):
        model = BartForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"BartForCausalLM.forward takes no position_ids.*each document's own"):
        find_adapter(model)


def test_chunked_attention_is_exact_only_within_a_chunk():
    model = tiny(
        "llama4_text", intermediate_size=32, intermediate_size_mlp=64, num_experts_per_tok=1, attention_chunk_size=16
    )
    data = make_data(3, seed=5)
    data.docs[1] = torch.arange(30) % 96  # longer than a chunk
    with pytest.raises(
        ValueError,
        match=r"a document of \d+ tokens is longer than 16: layer 0 is chunked attention "
        r"\(chunks of 16 tokens\)",
    ):
        run_packed(model, data, [0, 1, 2], Recompute.none())


class Unhooked(nn.Module):
    """A block whose token mixing never calls the installed attention (it averages the prefix)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.attn_block, self.mlp_block = block.attn_block, block.mlp_block

    def forward(self, x):
        x = x + torch.cumsum(x, 1) / torch.arange(1, x.shape[1] + 1)[None, :, None]
        return x + self.mlp_block(x)


def test_a_block_that_never_calls_the_installed_attention_is_an_error():
    model = TinyGQA()
    model.layers[1] = Unhooked(model.layers[1])
    data = make_data(3, seed=1)
    with pytest.raises(
        RuntimeError,
        match=r"block 1 \(Unhooked\) ran without calling the attention dcparallel "
        r"installed",
    ):
        run_packed(model, data, [0, 1], Recompute.none(), num_heads=4, num_kv_heads=2)


def test_an_hf_attention_replaced_after_wrapping_is_caught():
    model = build("gpt_neox")
    attn = model.gpt_neox.layers[1].attention
    dc = Engine(model)
    attn.forward = lambda *a, **k: _bypass(attn, *a, **k)  # structure checks passed: only the probe can see it
    collate = resolve_collate(dc.adapter.collate, dc.adapter.kind)
    data = make_data(2, seed=2)
    batch = collate({s: data.docs[s] for s in (0, 1)}, MicroBatch((0, 1), Layout(1, 2, Recompute.none())), (0,), 0)
    with pytest.raises(RuntimeError, match=r"block 1 \(GPTNeoXLayer\) ran without calling"):
        with dc.micro_batch(batch) as ctx:
            ctx.backward(dc.adapter.loss_fn(model, batch, ctx))


def _bypass(attn: nn.Module, hidden_states, *args, **kwargs):
    """GPT-NeoX attention with its own causal kernel (not the registered one)."""
    b, n, _ = hidden_states.shape
    q, k, v = attn.query_key_value(hidden_states).view(b, n, -1, 3 * attn.head_size).transpose(1, 2).chunk(3, -1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)
    return attn.dense(out), None


def test_the_probe_is_disarmed_once_every_block_called_the_attention():
    model = build("granitemoe")
    dc, _ = run_packed(model, make_data(2, seed=3), [0, 1], Recompute(1, 1))
    assert dc.attention_verified and not dc.attention_probe._handles
    assert dc.attention_probe.called == {0, 1}


#: families the adapter supports (the table of docs/models.md), world-1 parity with packed documents;
#: config overrides where the family needs them
SUPPORTED = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen2_moe": {},
    "qwen3_moe": {},
    "mixtral": {},
    "gemma": {},
    "gemma3_text": {},
    "phi": {},
    "olmo": {},
    "olmo2": {},
    "olmoe": {},
    "granite": {},
    "cohere": {},
    "stablelm": {},
    "starcoder2": {},
    "nemotron": {},
    "persimmon": {},
    "helium": {},
    "bitnet": {},
    "arcee": {},
    "apertus": {},
    "exaone4": {},
    "ernie4_5": {},
    "seed_oss": {"attention_dropout": 0.0, "residual_dropout": 0.0},
    "hunyuan_v1_dense": {},
    "glm4_moe": {},
    "cohere2": {},
    "jetmoe": {"kv_channels": 16, "intermediate_size": 32},
    "gpt_neox": {"rotary_pct": 0.5},
    "granitemoe": {"intermediate_size": 32, "attention_multiplier": 0.25},
    "llama4_text": {
        "intermediate_size": 32,
        "intermediate_size_mlp": 64,
        "num_experts_per_tok": 1,
        "no_rope_layers": [1, 0],
    },
}
#: mixture-of-experts families: their expert kernels (grouped matmuls) take no float64
MOE = {"jetmoe", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "granitemoe", "llama4_text"}


@pytest.mark.parametrize("family", list(SUPPORTED))
def test_supported_families_at_world_1(family):
    """Three documents packed into one row at SP 1, attention and MLP recomputed in layer 0:
    loss and every gradient equal the unmodified model's, one document at a time (packing
    alone catches attention across documents and positions counted over the row). float64
    where the family allows (a scalar parameter's gradient, Apertus' activation, sums every
    position with cancellation, which fp32 reordering moves by about 1e-5), fp32 for MoE."""
    data = make_data(3, seed=7)
    dtype = torch.float32 if family in MOE else torch.float64
    ref_loss, ref_grads = reference(tiny(family, **SUPPORTED[family]).to(dtype), data, [0, 1, 2])
    model = tiny(family, **SUPPORTED[family]).to(dtype)
    _, loss = run_packed(model, data, [0, 1, 2], Recompute(1, 1))
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    for name, p in model.named_parameters():
        if name in ref_grads:
            assert rel_err(p.grad, ref_grads[name]) <= 1e-5, (family, name, rel_err(p.grad, ref_grads[name]))
        else:  # never used by the unmodified model either (an unused expert): no gradient
            assert p.grad is None or not p.grad.any(), (family, name)


#: further families docs/models.md lists as refused, with the reason's words (structure only, meta device)
MORE_REFUSED = {
    "qwen3_5_text": "GatedDeltaNet",
    "bamba": "BambaMixer",
    "jamba": "Mamba",
    "nemotron_h": "Mamba2Mixer",
    "recurrent_gemma": "RecurrentGemmaRecurrentBlock",
    "mamba": "MambaMixer",
    "rwkv": "RwkvSelfAttention",
    "xlstm": "xLSTMLayer",
    "gpt_neo": "GPTNeoAttention) itself",
    "xglm": "XGLMAttention) itself",
    "bloom": "BloomAttention) itself",
    "mpt": "MptAttention) itself",
    "deepseek_v32": "'indexed_attention'",
    "glm_moe_dsa": "'indexed_attention'",
    "deepseek_v4": "'heavily_compressed_attention'",
    "zaya": "'hybrid'",
    "bart": "takes no position_ids",
}


OVERRIDES = {"zaya": {"num_experts_per_tok": 1}}


@pytest.mark.parametrize("family", list(MORE_REFUSED))
def test_more_families_are_refused(family):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with pytest.raises(ValueError) as e:
        find_adapter(tiny(family, meta=True, **OVERRIDES.get(family, {})))
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family] in str(e.value) and MORE_REFUSED[family] in str(e.value), str(
        e.value
    )
