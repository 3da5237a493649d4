"""Reference models on one device: shapes, losses, sizes, and the attention kernel."""

from __future__ import annotations

import pytest
import torch

from dcparallel.loss import per_token_loss, shift_labels
from dcparallel.models.attention import AttnPattern, sdpa_attention
from dcparallel.models.dit import DiT, DiTConfig, draw_flow, flow_matching_loss, patchify
from dcparallel.models.llama import Llama, LlamaConfig

torch.set_num_threads(1)


def test_llama_shapes_loss_and_tied_head():
    torch.manual_seed(0)
    m = Llama(LlamaConfig.tiny(tie_embeddings=True))
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        logits = m(ids)
    assert logits.shape == (2, 11, 256)
    ptl, mask = per_token_loss(logits, torch.stack([shift_labels(r) for r in ids]))
    assert ptl.shape == (2, 11) and mask.sum() == 2 * 10 and float(ptl[~mask].abs().sum()) == 0.0
    # a random model's loss is near log(vocab)
    assert abs(float(ptl[mask].mean()) - torch.log(torch.tensor(256.0))) < 0.5
    assert m.head.weight is m.embed.weight


def test_llama_rotary_positions_are_relative_and_used():
    torch.manual_seed(0)
    m = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 256, (1, 9))
    pos = torch.arange(9)[None]
    base = m(ids, pos)
    # rotary attention depends on position differences only
    torch.testing.assert_close(m(ids, pos + 100), base, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(m(ids, pos * 2), base, atol=1e-3)


def test_model_sizes_from_tiny_to_7b_and_1b():
    with torch.device("meta"):
        llama = Llama(LlamaConfig.llama_7b())
        dit = DiT(DiTConfig.dit_1b())
    n_llama = sum(p.numel() for p in llama.parameters())
    n_dit = sum(p.numel() for p in dit.parameters())
    assert 6.7e9 < n_llama < 6.8e9  # Llama-2-7B: 6.74B
    assert 1.0e9 < n_dit < 1.2e9


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="hidden 30"):
        LlamaConfig(hidden=30, num_heads=4)
    with pytest.raises(ValueError, match="attention must be"):
        DiTConfig(attention="sparse")
    with pytest.raises(ValueError, match="not divisible by the patch"):
        patchify(torch.zeros(4, 2, 5, 4), (1, 2, 2))


def test_patchify_is_frame_major_with_positions():
    lat = torch.arange(4 * 2 * 4 * 6, dtype=torch.float32).reshape(4, 2, 4, 6)
    tok, pos, grid = patchify(lat, (1, 2, 2))
    assert tok.shape == (2 * 2 * 3, 16) and grid == (2, 6)
    assert pos[0].tolist() == [0, 0, 0] and pos[6].tolist() == [1, 0, 0] and pos[1].tolist() == [0, 0, 1]
    # token 7 = frame 1, patch row 0, patch column 1: its first channel-0 pixel
    assert tok[7, 0] == lat[0, 1, 0, 2]


@pytest.mark.parametrize("attention", ["full", "factorized"])
def test_dit_forward_and_flow_loss(attention):
    torch.manual_seed(0)
    cfg = DiTConfig.tiny(attention=attention)
    m = DiT(cfg)
    tok, pos, (frames, _) = patchify(torch.randn(4, 3, 4, 4), cfg.patch)
    g = torch.Generator().manual_seed(1)
    t, noise = draw_flow(g, tok.shape[0], cfg.patch_dim)
    assert 0 < float(t) < 1 and noise.shape == tok.shape
    ptl = flow_matching_loss(m, tok[None], pos[None], t[None], noise[None], frames)
    assert ptl.shape == (1, tok.shape[0]) and torch.isfinite(ptl).all()
    ptl.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_draw_flow_is_a_function_of_the_generator_seed():
    a = draw_flow(torch.Generator().manual_seed(7), 5, 3)
    b = draw_flow(torch.Generator().manual_seed(7), 5, 3)
    c = draw_flow(torch.Generator().manual_seed(8), 5, 3)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) and not torch.equal(a[1], c[1])


def test_packed_documents_do_not_attend_across_and_padding_is_zero():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cu = [0, 3, 8, 10]  # documents of 3, 5 and 2 tokens, then 2 padding positions
    out = sdpa_attention(q, k, v, AttnPattern("causal"), cu)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        alone = sdpa_attention(q[:, a:b], k[:, a:b], v[:, a:b], AttnPattern("causal"))
        torch.testing.assert_close(out[:, a:b], alone)
    assert float(out[:, 10:].abs().max()) == 0.0


def test_factorized_patterns_equal_per_frame_and_per_position_attention():
    g = torch.Generator().manual_seed(0)
    t, s = 3, 4
    q, k, v = (torch.randn(2, t * s, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    spatial = sdpa_attention(q, k, v, AttnPattern("spatial", t))
    temporal = sdpa_attention(q, k, v, AttnPattern("temporal", t))
    for f in range(t):
        sl = slice(f * s, (f + 1) * s)
        torch.testing.assert_close(spatial[:, sl], sdpa_attention(q[:, sl], k[:, sl], v[:, sl], AttnPattern("full")))
    for j in range(s):
        idx = torch.arange(t) * s + j
        ref = sdpa_attention(q[:, idx], k[:, idx], v[:, idx], AttnPattern("full"))
        torch.testing.assert_close(temporal[:, idx], ref)
    with pytest.raises(ValueError, match="frames dividing"):
        sdpa_attention(q, k, v, AttnPattern("spatial", 5))
