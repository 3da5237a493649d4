"""The ring's fused block attention (`runtime.ring_fused`) on a CPU-only machine.

* Selection and shapes: with fake CUDA tensors (FakeTensorMode: torch's meta kernels of the
  memory-efficient attention ops, nothing computed) `fused_kernel` picks the CUDA kernel for
  bf16 / fp16 / fp32 inputs of equal head sizes divisible by 8, and `fused_attend` /
  `fused_grads` / `ring.pair_attend` give the fp32 path's shapes and dtypes; CPU inputs and
  the other head sizes keep the fp32 path.
* The wrapper's arithmetic: with torch's CPU flash attention (which also returns the
  log-sum-exp and takes the caller's output and log-sum-exp in backward) standing in for the
  CUDA kernel, `fused_attend` and `fused_grads` equal the fp32 `attend_block` and
  `block_grads` within 1e-5 (fp32; two kernels summing in other orders) — the mask as a bias,
  rows that see no key, grouped-query heads, and gradients under a softmax merged over two
  blocks (the ring's case), not the block's own. The CUDA kernel's own numbers are checked by
  the device check (part c: ring degree 2 in bf16 against world 1) where a GPU is lent.
"""

from __future__ import annotations

import pytest
import torch

from dcparallel.runtime import ring_fused
from dcparallel.runtime.ring import attend_block, block_grads, merge_lse, pair_attend
from tests.support import rel_err

RTOL = 1e-5


def _cpu_flash() -> ring_fused.FusedKernel:
    aten = torch.ops.aten

    def forward(q, k, v, bias, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)

    def backward(dout, q, k, v, bias, out, lse, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
        )

    return ring_fused.FusedKernel("cpu-flash", forward, backward)


def _masks(lq: int, lk: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A chunk pair's (Lq, Lk) mask, a joint text mask (B, 1, Lq, Lk) and a key mask (Lk,),
    each with rows that see no key."""
    pair = torch.rand(lq, lk, generator=g) > 0.4
    pair[1] = False
    joint = torch.rand(2, 1, lq, lk, generator=g) > 0.3
    joint[1, 0, -1] = False
    keys = torch.ones(lk, dtype=torch.bool)
    keys[-2:] = False
    return {"pair": pair, "joint": joint, "keys": keys}


@pytest.mark.parametrize("kind", ["pair", "joint", "keys"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_fused_wrapper_matches_the_fp32_block_attention(kind, kv_heads):
    g = torch.Generator().manual_seed(kv_heads)
    b, lq, lk, h, d = 2, 7, 6, 4, 8
    q = torch.randn(b, lq, h, d, generator=g)
    k, v, k2, v2 = (torch.randn(b, lk, kv_heads, d, generator=g) for _ in range(4))
    mask, other = _masks(lq, lk, g)[kind], torch.ones(lq, lk, dtype=torch.bool)
    other[1] = False  # under the pair mask, query row 1 sees no key of either block
    kernel, scale = _cpu_flash(), d**-0.5

    o, lse = ring_fused.fused_attend(kernel, q, k, v, mask, scale)
    want_o, want_lse = attend_block(q, k, v, mask, scale)
    assert rel_err(o, want_o) <= RTOL
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))  # rows that see nothing: -inf
    assert rel_err(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)]) <= RTOL
    assert not torch.isnan(o).any()

    # the ring's backward: this block's gradients under the softmax over it and a second block
    out, whole = merge_lse(want_o, want_lse, *attend_block(q, k2, v2, other, scale))
    do = torch.randn(b, lq, h, d, generator=g)
    delta = (do * out).sum(-1).transpose(1, 2)
    want = [torch.zeros_like(x) for x in (q, k, v)]
    block_grads(q, k, v, do, whole, delta, mask, scale, *want)
    got = ring_fused.fused_grads(kernel, q, k, v, do, out, whole, mask, scale)
    for name, x, y in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert x.shape == y.shape and x.dtype == torch.float32, name
        assert rel_err(x, y) <= RTOL, (name, rel_err(x, y))


def test_fused_kernel_is_the_cuda_path_only():
    fake = pytest.importorskip("torch._subclasses.fake_tensor")
    mode = fake.FakeTensorMode(allow_non_fake_inputs=True)

    def cuda(*shape, dtype=torch.bfloat16):
        return fake.FakeTensor(mode, torch.empty(*shape, dtype=dtype, device="meta"), torch.device("cuda", 0))

    cpu = torch.zeros(2, 6, 4, 8)
    assert ring_fused.fused_kernel(cpu, cpu, cpu) is None  # the fp32 reference on CPU
    with mode:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            q, kv = cuda(2, 6, 4, 8, dtype=dtype), cuda(2, 5, 2, 8, dtype=dtype)
            assert ring_fused.fused_kernel(q, kv, kv).name == "efficient-attention"
        q = cuda(2, 6, 4, 8)
        assert ring_fused.fused_kernel(q, q, cuda(2, 6, 4, 16)) is None  # a value head size of its own
        assert ring_fused.fused_kernel(*(cuda(2, 6, 4, 12),) * 3) is None  # head size not a multiple of 8
        assert ring_fused.fused_kernel(q, q, cuda(2, 6, 4, 8, dtype=torch.float16)) is None


def test_cuda_path_shapes_and_dtypes_match_the_fp32_path():
    """Under FakeTensorMode (the ops' meta kernels): the shapes and dtypes the ring merges
    and accumulates, for bf16 inputs with grouped-query heads and a joint mask."""
    fake = pytest.importorskip("torch._subclasses.fake_tensor")
    mode = fake.FakeTensorMode(allow_non_fake_inputs=True)

    def cuda(*shape, dtype=torch.bfloat16):
        return fake.FakeTensor(mode, torch.empty(*shape, dtype=dtype, device="meta"), torch.device("cuda", 0))

    b, lq, lk, h, kv, d = 2, 37, 21, 4, 2, 8
    with mode:
        q, k, v = cuda(b, lq, h, d), cuda(b, lk, kv, d), cuda(b, lk, kv, d)
        mask = torch.ones(b, 1, lq, lk, dtype=torch.bool)
        kernel = ring_fused.fused_kernel(q, k, v)
        o, lse = pair_attend(kernel, q, k, v, mask, 0.35)
        assert (o.shape, o.dtype, o.device.type) == ((b, lq, h, d), torch.float32, "cuda")
        assert (lse.shape, lse.dtype) == ((b, h, lq), torch.float32)
        dq, dk, dv = ring_fused.fused_grads(kernel, q, k, v, o, o, lse, mask, 0.35)
        assert (dq.shape, dk.shape, dv.shape) == ((b, lq, h, d), (b, lk, kv, d), (b, lk, kv, d))
        assert {t.dtype for t in (dq, dk, dv)} == {torch.float32}
