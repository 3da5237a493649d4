"""Bidirectional blocks (Gemma 3's images, `AttnPattern.blocks`): the per-document kernels
against transformers' own mask functions on a packed row, and the refusals (ring, a kernel
that does not declare them, pan-and-scan crops)."""

from __future__ import annotations

import pytest
import torch

from dcparallel.adapters.vlm_gemma3 import image_blocks
from dcparallel.data.vision_collate import collate_vision
from dcparallel.models.attention import AttnFeatures, AttnPattern, attention_kernel, sdpa_attention
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.ring import check_ring_pattern
from dcparallel.runtime.ulysses import ulysses_attention
from dcparallel.spec import Layout, Recompute
from tests.support import rel_err

masking = pytest.importorskip("transformers.masking_utils")

IMG = 9
#: two documents and 2 padding positions: images of 3 and 4 tokens, then one of 2 tokens
ROW = [1, IMG, IMG, IMG, 2, IMG, IMG, IMG, IMG, 3] + [4, 5, IMG, IMG, 6, 7]
CU = (0, 10, 16)


def _reference(q, k, v, window):
    """Each document alone, attended under transformers' Gemma 3 mask: (causal OR same image
    block) AND (the sliding window), the block ids from its ``token_type_ids``."""
    out = torch.zeros_like(q)
    for a, b in zip(CU[:-1], CU[1:], strict=True):
        types = (torch.tensor(ROW[a:b]) == IMG).long()[None]
        is_prev = torch.nn.functional.pad(types == 1, (1, 0))[:, :-1]
        ids = torch.where(types == 1, torch.cumsum(((types == 1) & ~is_prev).int(), 1) - 1, -1)
        fn = masking.or_masks(masking.causal_mask_function, masking.blockwise_overlay(ids))
        if window is not None:
            fn = masking.and_masks(masking.sliding_window_overlay(window), fn)
        n = b - a
        idx, zero = torch.arange(n), torch.tensor(0)
        allowed = fn(zero, zero, idx[:, None], idx[None, :]).expand(n, n)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2), v[:, a:b].transpose(1, 2), attn_mask=allowed
        )
        out[:, a:b] = attn.transpose(1, 2)
    return out


def _batch_blocks():
    mb = MicroBatch((0, 1), Layout(1, 1, Recompute.none()))
    samples = {0: torch.tensor(ROW[:10]), 1: torch.tensor(ROW[10:16])}
    return image_blocks(collate_vision(samples, mb, (0,), 0), IMG)


def test_image_blocks_are_the_runs_of_image_tokens_per_document():
    assert _batch_blocks() == ((1, 4), (5, 9), (12, 14))


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["sdpa", "eager"])
@pytest.mark.parametrize("window", [None, 2, 3])
def test_blocks_match_transformers_gemma3_mask(window, softcap):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 18, 2, 4, generator=g) for _ in range(3))
    pattern = AttnPattern("causal", window=window, blocks=_batch_blocks())
    out = sdpa_attention(q, k, v, pattern, CU)
    if softcap is None:
        ref = _reference(q, k, v, window)
        assert rel_err(out[:, :16], ref[:, :16]) < 1e-6
        causal = sdpa_attention(q, k, v, AttnPattern("causal", window=window), CU)
        assert rel_err(causal[:, :16], ref[:, :16]) > 1e-2  # the blocks change the output
    else:  # the eager path (softcap) with a huge cap equals the SDPA path
        big = sdpa_attention(q, k, v, AttnPattern("causal", window=window, blocks=pattern.blocks, softcap=1e9), CU)
        assert rel_err(big, out) < 1e-5
    assert out[:, 16:].abs().max() == 0  # padding


def test_blocks_are_refused_under_ring_and_by_an_undeclared_kernel():
    pattern = AttnPattern("causal", blocks=((1, 4),))
    with pytest.raises(ValueError, match="ring attention .* bidirectional blocks .*Gemma 3"):
        check_ring_pattern(pattern, None, 2)
    q = torch.zeros(1, 6, 2, 4)

    def kernel(q, k, v, pattern, cu_seqlens=None):
        return q

    with pytest.raises(ValueError, match="bidirectional blocks.*supports_blocks"):
        ulysses_attention(q, q, q, pattern, group=None, kernel=kernel)
    with pytest.raises(ValueError, match="blocks open spans of causal attention"):
        AttnPattern("full", blocks=((0, 2),))


def test_blocks_go_to_the_per_document_reference_on_cuda_too():
    """varlen_attn and FlexAttention get no block mask: the reference computes blocks."""
    assert AttnFeatures.of(torch.zeros(1, 4, 2, 4), AttnPattern("causal", blocks=((0, 2),)), None).blocks
    for version in ((2, 10), (2, 11)):
        assert attention_kernel("cuda", torch.bfloat16, AttnFeatures("causal", blocks=True), version) == "loop"
        assert (
            attention_kernel("cuda", torch.bfloat16, AttnFeatures("causal", softcap=True, blocks=True), version)
            == "eager"
        )
    assert attention_kernel("cuda", torch.bfloat16, AttnFeatures("causal"), (2, 11)) == "varlen"


def test_pan_and_scan_crops_are_refused():
    sample = {
        "input_ids": torch.tensor(ROW[:10]),
        "pixel_values": torch.zeros(1, 3, 8, 8),
        "num_crops": torch.tensor([2]),
    }
    with pytest.raises(ValueError, match="pan-and-scan crops .*do_pan_and_scan=False"):
        collate_vision({0: sample}, MicroBatch((0,), Layout(1, 1, Recompute.none())), (0,), 0)
