"""The kernel's eager path at world 1: logit softcapping, attention sinks and a value head
size unlike the query/key one, on packed documents with padding, against attention written
out one document at a time (transformers' eager order: scale, cap, causal mask, sink column,
softmax, drop the sink, @ v). Outputs and the gradients of q, k, v and the sinks agree to
fp32 rounding (1e-5 relative); dropping the cap or the sinks moves them by far more."""

from __future__ import annotations

import pytest
import torch

from dcparallel.models.attention import AttnPattern, cuda_varlen_attention, sdpa_attention
from dcparallel.runtime.ulysses import ulysses_attention
from tests.support import rel_err

CU = (0, 5, 12, 13, 21)  # four documents (one of a single token), then 3 padding positions
LENGTH, HEADS, KV_HEADS = 24, 4, 2


def _reference(q, k, v, softcap, sinks, cu):
    """Per document and head, written out: (B, L, H, D) -> (B, L, H, Dv), padding zero."""
    b, length, h, d = q.shape
    out = q.new_zeros(b, length, h, v.shape[-1])
    rep = h // k.shape[2]
    for a, e in zip(cu[:-1], cu[1:]):
        for head in range(h):
            qs, ks, vs = q[:, a:e, head], k[:, a:e, head // rep], v[:, a:e, head // rep]
            s = qs @ ks.transpose(1, 2) / d**0.5
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            n = e - a
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks[head].expand(b, n, 1)], dim=-1)
            p = torch.softmax(s, dim=-1)
            if sinks is not None:
                p = p[..., :-1]
            out[:, a:e, head] = p @ vs
    return out


def _inputs(dv: int, scale: float = 3.0):
    g = torch.Generator().manual_seed(0)
    q = (scale * torch.randn(2, LENGTH, HEADS, 8, generator=g)).requires_grad_()
    k = (scale * torch.randn(2, LENGTH, KV_HEADS, 8, generator=g)).requires_grad_()
    v = torch.randn(2, LENGTH, KV_HEADS, dv, generator=g).requires_grad_()
    sinks = torch.randn(HEADS, generator=g).requires_grad_()
    return q, k, v, sinks


def _run(fn, q, k, v, sinks):
    out = fn()
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * w).sum(), [q, k, v] + ([sinks] if sinks is not None else []))
    return out.detach(), grads


@pytest.mark.parametrize(
    "softcap,use_sinks,dv",
    [(5.0, False, 8), (None, True, 8), (5.0, True, 6), (None, False, 6)],
    ids=["softcap", "sinks", "softcap+sinks+mla", "mla"],
)
def test_eager_path_matches_attention_written_out(softcap, use_sinks, dv):
    q, k, v, s = _inputs(dv)
    sinks = s if use_sinks else None
    pattern = AttnPattern("causal", softcap=softcap)
    for kernel in (sdpa_attention, cuda_varlen_attention):  # on CPU tensors the CUDA kernel takes the same path
        out, grads = _run(lambda kernel=kernel: kernel(q, k, v, pattern, CU, sinks), q, k, v, sinks)
        ref, ref_grads = _run(lambda: _reference(q, k, v, softcap, sinks, CU), q, k, v, sinks)
        assert out.shape == (2, LENGTH, HEADS, dv)
        assert rel_err(out, ref) <= 1e-5 and torch.all(out[:, CU[-1] :] == 0)
        for g, r in zip(grads, ref_grads, strict=True):
            assert rel_err(g, r) <= 1e-5
    # the same through Ulysses without a process group (the engine's path at SP 1)
    out1 = ulysses_attention(q, k, v, pattern, group=None, cu_seqlens=CU, sinks=sinks).detach()
    assert rel_err(out1, ref) <= 1e-5
    # what is computed matters: without the cap / the sinks the result moves far more than rounding
    if softcap is not None:
        assert rel_err(sdpa_attention(q, k, v, AttnPattern("causal"), CU, sinks).detach(), ref) > 1e-2
    if sinks is not None:
        assert rel_err(sdpa_attention(q, k, v, pattern, CU).detach(), ref) > 1e-2


def test_sinks_and_head_sizes_are_checked():
    q, k, v, sinks = _inputs(6)
    with pytest.raises(ValueError, match=r"one sink logit per query head is \(4,\)"):
        ulysses_attention(q, k, v, AttnPattern("causal"), group=None, sinks=sinks[:2])
    with pytest.raises(ValueError, match="keys the query head size"):
        ulysses_attention(q, v, v, AttnPattern("causal"), group=None)
    with pytest.raises(ValueError, match="softcap -1.0 must be a positive number"):
        AttnPattern("causal", softcap=-1.0)

    def plain_kernel(q, k, v, pattern, cu_seqlens=None):  # a user's kernel that knows neither
        return sdpa_attention(q, k, v, pattern, cu_seqlens)

    q, k, v, sinks = _inputs(8)
    assert ulysses_attention(q, k, v, AttnPattern("causal"), group=None, kernel=plain_kernel).shape == q.shape
    for pattern, s in ((AttnPattern("causal", softcap=5.0), None), (AttnPattern("causal"), sinks)):
        with pytest.raises(ValueError, match="kernel 'plain_kernel' does not declare"):
            ulysses_attention(q, k, v, pattern, group=None, kernel=plain_kernel, sinks=s)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: reaches the varlen branch's own gates on CPU."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_varlen_attn_only_gets_the_dtypes_its_flash_kernel_takes(monkeypatch):
    """varlen_attn's flash kernel raises on fp32 ("FlashAttention only support fp16 and bf16",
    an H200 run): fp32 takes the exact SDPA loop, fp16 / bf16 go to varlen_attn."""
    import dcparallel.models.attention as attention

    called = []

    def varlen(*args, **kwargs):
        called.append(args[0].dtype)
        raise RuntimeError("varlen_attn called")

    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen)
    q, k, v, _ = _inputs(8)  # one row, value heads the size of the query's: varlen_attn's case
    q, k, v = (t.detach()[:1] for t in (q, k, v))
    pattern = AttnPattern("causal")
    on_cuda = [torch.Tensor._make_subclass(_OnCuda, t) for t in (q, k, v)]
    out = cuda_varlen_attention(*on_cuda, pattern, CU)
    assert not called and rel_err(out.as_subclass(torch.Tensor), sdpa_attention(q, k, v, pattern, CU)) <= 1e-6
    for dtype in attention.VARLEN_DTYPES:
        with pytest.raises(RuntimeError, match="varlen_attn called"):
            cuda_varlen_attention(*(torch.Tensor._make_subclass(_OnCuda, t.to(dtype)) for t in (q, k, v)), pattern, CU)
    assert called == list(attention.VARLEN_DTYPES)
