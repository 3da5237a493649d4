"""The chunked cross-entropy (`dcparallel.loss.per_token_loss`): the values and gradients of
``F.cross_entropy`` on the fp32 logits, bit for bit (each chunk runs the same kernels on the same
rows), with a peak that never holds fp32 logits of all tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dcparallel import loss as loss_mod
from dcparallel.loss import IGNORE_INDEX, per_token_loss
from tests.memory import LiveBytes


def _reference(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(labels.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_cross_entropy_equals_the_unchunked_value_and_gradient(monkeypatch, dtype):
    monkeypatch.setattr(loss_mod, "CE_CHUNK_BYTES", 4 * 64 * 7)  # 7 tokens a chunk: 9 chunks, the last short
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, 64, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 64, (3, 20), generator=g)
    labels[0, :5] = IGNORE_INDEX
    weights = torch.rand(3, 20, generator=g)
    got, mask = per_token_loss(logits, labels)
    (got * weights).sum().backward()
    grad, logits.grad = logits.grad, None
    ref = _reference(logits, labels)
    (ref * weights).sum().backward()
    assert got.dtype == torch.float32 and torch.equal(mask, labels != IGNORE_INDEX)
    assert torch.equal(got, ref) and torch.equal(grad, logits.grad)
    assert not grad[0, :5].any() and grad.dtype == dtype


def _peak_bytes(fn) -> int:
    """Peak bytes ``fn`` (a loss forward + backward) adds to what is alive before it."""
    with LiveBytes() as meter:
        start = meter.now
        fn()
    return meter.peak - start


def test_chunked_cross_entropy_never_holds_fp32_logits_of_all_tokens(monkeypatch):
    """1024 tokens x 1024 vocabulary in bf16 (2 MiB; 4 MiB in fp32), chunks of 64 KiB: the
    peak is the bf16 gradient of the logits (half the fp32 size) and a few chunks; the
    unchunked loss holds fp32 logits, log-softmax and gradient (3x the fp32 size)."""
    monkeypatch.setattr(loss_mod, "CE_CHUNK_BYTES", 2**16)
    logits = torch.randn(1, 1024, 1024).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 1024, (1, 1024))
    fp32_bytes = logits.numel() * 4
    chunked = _peak_bytes(lambda: per_token_loss(logits, labels)[0].sum().backward())
    logits.grad = None
    unchunked = _peak_bytes(lambda: _reference(logits, labels).sum().backward())
    print(
        f"peak over the logits: chunked {chunked / 2**20:.1f} MiB, unchunked {unchunked / 2**20:.1f} MiB, "
        f"fp32 logits {fp32_bytes / 2**20:.0f} MiB"
    )
    assert chunked <= fp32_bytes / 2 + 8 * 2**16, (chunked, fp32_bytes)
    assert unchunked >= 1.5 * fp32_bytes  # the measure sees the reference's fp32 copies
