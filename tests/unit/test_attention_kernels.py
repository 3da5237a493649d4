"""The fused kernels' choice and their exactness on CPU.

`attention_kernel` is pure: which kernel each model family's attention calls take on CUDA is
asserted by running the family's real forward on CPU with the dispatcher told it is on CUDA
and the two fused kernels replaced by recorders (that compute the exact reference). The
FlexAttention path's forward runs on CPU (its backward does not, torch 2.13) and is checked
against the per-document SDPA / eager reference; the sinks' rescale by the log-sum-exp is
checked in forward and backward against sinks written into the softmax."""

from __future__ import annotations

import pytest
import torch

import dcparallel.models.attention as attention
from dcparallel.models.attention import AttnFeatures, AttnPattern, attention_kernel, sdpa_attention
from dcparallel.models.flex import sink_rescale
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from dcparallel.spec import Layout
from tests.support import rel_err

CU = (0, 5, 12, 13, 21)  # four documents (one of a single token), then 3 padding positions
LENGTH, HEADS, KV_HEADS = 24, 4, 2
V = (2, 13)


def test_the_kernel_choice_per_device_dtype_and_feature():
    plain, bf16 = AttnFeatures("causal"), torch.bfloat16
    assert attention_kernel("cpu", bf16, plain, V) == "loop"
    assert attention_kernel("cpu", bf16, AttnFeatures("causal", softcap=True), V) == "eager"
    assert attention_kernel("cuda", bf16, plain, V) == "varlen"
    assert attention_kernel("cuda", bf16, AttnFeatures("full"), V) == "varlen"
    assert attention_kernel("cuda", bf16, AttnFeatures("causal", window=True), V) == "varlen"
    assert attention_kernel("cuda", bf16, AttnFeatures("causal", window=True), (2, 10)) == "flex"
    for f in (AttnFeatures("causal", softcap=True), AttnFeatures("causal", sinks=True, window=True)):
        assert attention_kernel("cuda", bf16, f, V) == "flex"
        assert attention_kernel("cuda", torch.float32, f, V) == "flex"
        assert attention_kernel("cuda", bf16, f, (2, 8)) == "eager"
    assert attention_kernel("cuda", torch.float32, plain, V) == "loop"  # varlen_attn's flash takes no fp32
    assert attention_kernel("cuda", bf16, AttnFeatures("causal", one_row=False), V) == "loop"  # one SDPA call
    assert attention_kernel("cuda", bf16, AttnFeatures("spatial"), V) == "loop"
    assert attention_kernel("cuda", bf16, plain, (2, 8)) == "loop"


def _inputs(dtype, dv=8, rows=2):
    g = torch.Generator().manual_seed(0)
    q = 3 * torch.randn(rows, LENGTH, HEADS, 8, generator=g, dtype=dtype)
    k = 3 * torch.randn(rows, LENGTH, KV_HEADS, 8, generator=g, dtype=dtype)
    v = torch.randn(rows, LENGTH, KV_HEADS, dv, generator=g, dtype=dtype)
    return q, k, v, torch.randn(HEADS, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "pattern,use_sinks",
    [
        (AttnPattern("causal", softcap=5.0), False),
        (AttnPattern("causal"), True),
        (AttnPattern("causal", window=3), False),
        (AttnPattern("causal", softcap=5.0, window=4), True),
        (AttnPattern("full"), False),
    ],
    ids=["softcap", "sinks", "window", "all", "full"],
)
@pytest.mark.parametrize("dv", [8, 6], ids=["mha", "mla"])
def test_flex_forward_matches_the_reference_on_packed_documents(dtype, pattern, use_sinks, dv):
    """Grouped heads, padding and four documents: FlexAttention's output equals the exact
    per-document reference (the eager path's float32 softmax bounds the agreement at 1e-6),
    padding is zero, and no document sees another: changing one document's keys moves only
    its own outputs."""
    q, k, v, s = _inputs(dtype, dv)
    sinks = s if use_sinks else None
    out = attention._flex(q, k, v, pattern, CU, sinks)
    assert out.shape == (2, LENGTH, HEADS, dv) and torch.all(out[:, CU[-1] :] == 0)
    assert rel_err(out, sdpa_attention(q, k, v, pattern, CU, sinks)) <= 1e-6
    k2, v2 = k.clone(), v.clone()
    k2[:, 5:12], v2[:, 5:12] = -k2[:, 5:12], v2[:, 5:12] + 1
    moved = (attention._flex(q, k2, v2, pattern, CU, sinks) - out).abs().amax(dim=(0, 2, 3))
    assert torch.all(moved[5:12] > 0) and torch.all(moved[:5] == 0) and torch.all(moved[12:] == 0)


def test_the_sink_rescale_is_exact_in_forward_and_backward():
    """Attention without sinks and its log-sum-exp, rescaled: output and the gradients of q,
    k, v and the sinks equal the eager path's sink column in the softmax (fp64: 1e-10), so a
    kernel whose backward takes the log-sum-exp's gradient (FlexAttention's) is exact."""
    q, k, v, sinks = (t.double().requires_grad_() for t in _inputs(torch.float64, rows=1))
    length, rep = q.shape[1], HEADS // KV_HEADS
    scores = torch.einsum("nlhd,nmhd->nhlm", q, k.repeat_interleave(rep, 2)) * 8**-0.5
    doc = torch.searchsorted(torch.tensor(CU[1:]), torch.arange(length), right=True)
    idx = torch.arange(length)
    seen = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    plain = torch.einsum("nhlm,nmhd->nhld", torch.softmax(scores, -1), v.repeat_interleave(rep, 2))
    out = sink_rescale(plain, lse, sinks).transpose(1, 2)[:, : CU[-1]]
    ref = sdpa_attention(q, k, v, AttnPattern("causal"), CU, sinks)[:, : CU[-1]]
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v, sinks))
    assert rel_err(out, ref) <= 1e-6  # the eager softmax is float32
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) <= 1e-6


def test_varlen_gets_grouped_heads_as_they_are_and_values_padded_to_the_key_size(monkeypatch):
    """varlen_attn with `enable_gqa` gets the 2 key/value heads (not 4 repeated ones); a
    value head of 6 reaches it padded to the key's 8 and the output is sliced back: equal to
    the reference. Without `enable_gqa` (an older varlen_attn) the heads are repeated."""
    seen = []

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        seen.append((k.shape[1], v.shape[-1], enable_gqa, window_size, cu_q.dtype, max_q))
        rows = [
            sdpa_attention(q[None, a:b], k[None, a:b], v[None, a:b], AttnPattern("causal"))[0]
            for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True)
        ]
        return torch.cat(rows)

    monkeypatch.setattr(attention, "_varlen_attn", lambda: fake)
    monkeypatch.setattr(attention, "_varlen_params", lambda: frozenset(("enable_gqa", "window_size")))
    q, k, v, _ = _inputs(torch.float64, dv=6, rows=1)
    out = attention._varlen(q, k, v, AttnPattern("causal"), CU)
    assert seen == [(KV_HEADS, 8, True, (-1, 0), torch.int32, 8)]
    assert (
        out.shape == (1, LENGTH, HEADS, 6) and rel_err(out, sdpa_attention(q, k, v, AttnPattern("causal"), CU)) <= 1e-12
    )
    monkeypatch.setattr(attention, "_varlen_params", lambda: frozenset(("window_size",)))
    attention._varlen(q, k, v, AttnPattern("causal", window=4), CU)
    assert seen[-1][:4] == (HEADS, 8, False, (3, 0))


def _record_kernels(monkeypatch) -> list[str]:
    """The dispatcher believes it runs on CUDA with torch 2.13 and records each choice; the
    fused kernels compute the reference (they cannot run on CPU)."""
    taken: list[str] = []
    choose = attention.attention_kernel

    def recorded(*args):
        taken.append(choose(*args))
        return taken[-1]

    monkeypatch.setattr(attention, "_device_type", lambda q: "cuda")
    monkeypatch.setattr(attention, "_torch_version", lambda: V)
    monkeypatch.setattr(attention, "attention_kernel", recorded)
    monkeypatch.setattr(attention, "_varlen", lambda q, k, v, pattern, cu: sdpa_attention(q, k, v, pattern, cu))
    monkeypatch.setattr(attention, "_flex", sdpa_attention)
    return taken


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    return MistralForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _text_model(kind):
    from tests import adapter_models

    return _mistral() if kind == "hf-mistral" else adapter_models.build(kind)


@pytest.mark.parametrize(
    "kind,want",
    [
        ("hf-llama", {"varlen"}),
        ("hf-qwen3", {"varlen"}),
        ("hf-mistral", {"varlen"}),
        ("hf-gemma2", {"flex"}),
        ("hf-gpt-oss", {"flex"}),
        ("hf-deepseek-v3", {"varlen"}),
        ("reference-llama", {"varlen"}),
    ],
)
def test_each_text_family_takes_a_fused_kernel_on_cuda(monkeypatch, kind, want):
    """bf16, one packed row of two documents (40 and 9 tokens, longer than Mistral's window):
    Gemma 2 (softcap) and gpt-oss (sinks, sliding window) take FlexAttention; Llama, Qwen3
    (grouped heads), Mistral (sliding window) and DeepSeek-V3 (a value head unlike the key's)
    take varlen_attn; none takes the per-document loop or the eager scores."""
    pytest.importorskip("transformers")
    from dcparallel.data.collate import resolve_collate
    from dcparallel.models.llama import Llama, LlamaConfig

    model = (
        Llama(LlamaConfig(vocab_size=96, hidden=32, num_layers=2, num_heads=4, ffn_hidden=64))
        if kind == "reference-llama"
        else _text_model(kind)
    ).to(torch.bfloat16)
    taken = _record_kernels(monkeypatch)
    dc = Engine(model, kernel=attention.cuda_varlen_attention)
    docs = {i: torch.randint(0, 96, (n,)) for i, n in enumerate((40, 9))}
    batch = resolve_collate("text", "text")(docs, MicroBatch((0, 1), Layout(1, 1)), (0,), 0)
    with torch.no_grad(), dc.micro_batch(batch) as ctx:
        dc.adapter.loss_fn(model, batch, ctx)
    assert taken and set(taken) == want


@pytest.mark.parametrize("kind", ["dit-full", "dit-factorized", "wan"])
def test_video_families_take_their_kernel_on_cuda(monkeypatch, kind):
    """One bf16 video sample per micro-batch: full attention (the reference DiT, diffusers
    Wan) takes varlen_attn; the DiT's factorized spatial / temporal attention folds frames
    into rows, one SDPA call each (the loop path)."""
    from dcparallel.adapters.reference import dit_samples
    from dcparallel.data.collate import resolve_collate
    from dcparallel.models.dit import DiT, DiTConfig

    if kind == "wan":
        pytest.importorskip("diffusers")
        from tests.adapter_models import build, item, make_data

        data, model = make_data("wan", 1, 3), build("wan").to(torch.bfloat16)
        samples = {0: item(data, 0)}
    else:
        model = DiT(
            DiTConfig(
                num_layers=2,
                num_heads=4,
                hidden=32,
                freq_dim=16,
                attention="factorized" if kind == "dit-factorized" else "full",
            )
        ).to(torch.bfloat16)
        samples = {0: dit_samples(model)((17, 32, 48), 0)}
    taken = _record_kernels(monkeypatch)
    dc = Engine(model, kernel=attention.cuda_varlen_attention)
    batch = resolve_collate(dc.adapter.collate, "video")(samples, MicroBatch((0,), Layout(1, 1)), (0,), 0)
    with torch.no_grad(), dc.micro_batch(batch) as ctx:
        dc.adapter.loss_fn(model, batch, ctx)
    assert set(taken) == ({"loop"} if kind == "dit-factorized" else {"varlen"})


def _nodes(fn) -> list[str]:
    """The names of every autograd node behind ``fn``."""
    seen, todo, names = set(), [fn], []
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.append(type(f).__name__)
        todo.extend(g for g, _ in f.next_functions)
    return names


def test_a_packed_row_s_backward_gathers_its_documents_once():
    """The CPU kernel's per-document loop splits q, k and v once: a slice per document would
    write each document's gradient into a zero tensor of the whole row (D documents: D rows
    of memory traffic, a packed micro-batch's attention 1.7-1.9x slower on a CPU)."""
    cu = (0, 5, 9, 16, 20, 27)
    q, k, v = (torch.randn(1, 30, 2, 4, requires_grad=True) for _ in range(3))
    out = sdpa_attention(q, k, v, AttnPattern("causal"), cu)
    names = _nodes(out.grad_fn)
    assert names.count("SplitWithSizesBackward0") == 3 and "SliceBackward0" not in names, names
    out.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    ref = [sdpa_attention(q[:, a:b], k[:, a:b], v[:, a:b], AttnPattern("causal")) for a, b in zip(cu, cu[1:])]
    torch.cat([*ref, q.new_zeros(1, 3, 2, 4)], dim=1).square().sum().backward()
    assert all(torch.equal(g, x.grad) for g, x in zip(grads, (q, k, v), strict=True))
