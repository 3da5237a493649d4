"""The analytic cost model prices the all-to-alls and ring steps the runtime makes: each call's
latency once, and the bytes it moves.

The reference models run one forward and backward as rank 0 of an SP group through the
runtime's own attention (`runtime.ulysses.UlyssesAttention`) and recompute wrappers
(`runtime.recompute`), with `torch.distributed` inside `runtime.comm` swapped for a counter of
``all_to_all_single`` calls and of the bytes each sends (its output a copy of its input: the
shapes and dtypes are the real ones, the values are not checked). Ring attention's
point-to-point steps are counted likewise (`comm.RingShift` swapped for a counter). The cost
model's count is read off its prices: a cluster with link latency and unbounded bandwidth
against the same without latency, per layer and per unit of ``latency * (sp - 1)``; its bytes
from a cluster of 1 byte/s against unbounded bandwidth, per layer and per ``(sp - 1) / sp``
of what a rank holds (`cost.base.alltoall_time`)."""

from __future__ import annotations

import types

import pytest
import torch

from dcparallel.adapters.reference import adapter as reference_adapter
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.ring import split_time
from dcparallel.models.attention import AttnPattern
from dcparallel.models.dit import DiT, DiTConfig
from dcparallel.models.llama import CAUSAL, Llama, LlamaConfig
from dcparallel.runtime import comm, ring
from dcparallel.runtime.recompute import LayerRecompute
from dcparallel.runtime.ulysses import UlyssesAttention, ulysses_attention
from dcparallel.scenarios import MODEL_PRESETS
from dcparallel.spec import ClusterSpec, ModelSpec, Recompute

SP, LAYERS, LOCAL = 2, 2, 16
LATENCY = 1e-3


class CountingDist:
    """`torch.distributed` as `runtime.comm` uses it in Ulysses attention, counting calls and
    the bytes each call's input holds (what one rank of the group sends and keeps)."""

    def __init__(self):
        self.calls = 0
        self.bytes = 0

    def get_world_size(self, group=None):
        return group.size

    def get_rank(self, group=None):
        return 0

    def all_to_all_single(self, out, x, group=None):
        self.calls += 1
        self.bytes += x.numel() * x.element_size()
        out.copy_(x)


def counting(monkeypatch) -> CountingDist:
    counter = CountingDist()
    monkeypatch.setattr(comm, "dist", counter)
    monkeypatch.setattr(comm, "is_distributed", lambda: True)
    return counter


#: the reference families at 8 heads (every SP degree up to 8 divides them); bf16 as trained
FAMILIES = {
    "text": lambda: Llama(LlamaConfig(vocab_size=64, hidden=64, num_layers=2, num_heads=8, ffn_hidden=96)),
    "video-full": lambda: DiT(DiTConfig(hidden=64, num_layers=2, num_heads=8, attention="full")),
    # 4 blocks: 2 spatial + temporal pairs, 2 planner layers
    "video-factorized": lambda: DiT(DiTConfig(hidden=64, num_layers=4, num_heads=8, attention="factorized")),
}
#: sample sizes per kind: tokens; (frames, height, width) pixels (latent grids 5 x 32, 10 x 32, 1 x 128)
SIZES = {"text": [64, 96], "video": [(17, 64, 128), (34, 128, 64), (1, 128, 256)]}


def run_layers(monkeypatch, model, spec: ModelSpec, size, sp: int, recompute: Recompute) -> tuple[int, ...]:
    """(calls, bytes) of the forward, then of the backward, of one micro-batch of one sample of
    ``size`` at SP ``sp`` as rank 0 runs it: the model's whole forward and backward."""
    torch.manual_seed(0)
    ad = reference_adapter(model)
    attention = UlyssesAttention()
    ad.install_attention(attention)
    LayerRecompute(ad, attention).set(recompute)
    counter = counting(monkeypatch)
    attention.activate(types.SimpleNamespace(size=sp), None)
    n = spec.tokens(size)
    assert n % sp == 0, (size, sp)
    if spec.kind == "text":
        out = model(torch.randint(0, 64, (1, n // sp)), torch.arange(n // sp)[None])
    else:
        frames = spec.latent_grid(size)[0]
        x = torch.randn(1, n // sp, model.cfg.patch_dim, dtype=torch.bfloat16)
        out = model(x, torch.zeros(1, n // sp, 3, dtype=torch.long), torch.rand(1), frames)
    forward = (counter.calls, counter.bytes)
    out.float().pow(2).mean().backward()
    return (*forward, counter.calls - forward[0], counter.bytes - forward[1])


def cluster(sp: int, latency: float, bw: float) -> ClusterSpec:
    return ClusterSpec(
        world_size=sp,
        gpus_per_node=sp,
        memory_bytes=2**34,
        intra_bw=bw,
        inter_bw=bw,
        intra_latency=latency,
        inter_latency=latency,
        name="cpu",
    )


def priced(spec: ModelSpec, size, sp: int, recompute: Recompute) -> tuple[float, float]:
    """(calls, bytes) the analytic model charges per layer of that micro-batch at ``sp``,
    forward and backward (and the recomputed forward), read off its prices."""

    def price(latency: float, bw: float) -> float:
        return AnalyticCost(spec, cluster(sp, latency, bw)).terms((size,), sp).time(recompute)

    calls = (price(LATENCY, 1e30) - price(0.0, 1e30)) / spec.num_layers / (LATENCY * (sp - 1))
    nbytes = (price(0.0, 1.0) - price(0.0, 1e30)) / spec.num_layers * sp / (sp - 1)
    return calls, nbytes


@pytest.mark.parametrize("sp", [2, 4, 8])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_cost_model_prices_the_bytes_and_calls_of_every_all_to_all_the_runtime_makes(monkeypatch, family, sp):
    model = FAMILIES[family]().to(torch.bfloat16)
    spec = reference_adapter(model).spec
    assert spec.attention == family.split("-")[-1].replace("text", "causal")
    blocks = spec.attn_per_layer  # attention sub-blocks per planner layer: 2 for a factorized pair
    for size in SIZES[spec.kind]:
        fc, fb, bc, bb = (v / spec.num_layers for v in run_layers(monkeypatch, model, spec, size, sp, Recompute()))
        assert (fc, bc) == (2 * blocks, 2 * blocks)  # per sub-block q, k, v together and the output back
        # per sub-block q, k, v and the output at the whole hidden size (multi-head): 4 units of
        # a rank's share of the tokens, one way; backward mirrors it
        assert fb == bb == blocks * 4 * spec.tokens(size) // sp * spec.hidden * 2, size
        assert priced(spec, size, sp, Recompute()) == pytest.approx((fc + bc, fb + bb), rel=1e-6), size


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recomputed_attention_is_priced_with_the_all_to_alls_it_repeats(monkeypatch, family):
    model = FAMILIES[family]().to(torch.bfloat16)
    spec = reference_adapter(model).spec
    size = SIZES[spec.kind][0]
    recompute = Recompute(spec.num_layers, 0)
    fc, fb, bc, bb = (v / spec.num_layers for v in run_layers(monkeypatch, model, spec, size, SP, recompute))
    assert (bc, bb) == (2 * fc, 2 * fb)  # the recomputed forward's, then both mirrored
    assert priced(spec, size, SP, recompute) == pytest.approx((fc + bc, fb + bb), rel=1e-6)


#: grouped-query (Llama 3.1 8B: 32 query heads, 8 key/value heads, repeated at SP 16) and
#: multi-head latent attention (DeepSeek-V2-Lite: 16 heads, query/key heads of 192, values of 128)
MLA = ModelSpec(
    name="deepseek-v2-lite-attention",
    kind="text",
    num_layers=1,
    hidden=2048,
    num_heads=16,
    ffn_hidden=10944,
    attention="causal",
    attn_params=2048 * 16 * 192 + 2048 * (512 + 64) + 512 * 16 * (128 + 128) + 16 * 128 * 2048 + 512,
    mlp_params=3 * 2048 * 10944,  # its first layer's dense MLP
    head_dim=192,
    v_head_dim=128,
)


@pytest.mark.parametrize(
    ("spec", "sp"),
    [(MODEL_PRESETS["llama-8b"], 4), (MODEL_PRESETS["llama-8b"], 16), (MLA, 8)],
    ids=["gqa-4", "gqa-16", "mla-8"],
)
def test_grouped_and_latent_heads_are_priced_at_the_bytes_they_move(monkeypatch, spec, sp):
    counter = counting(monkeypatch)
    dqk = spec.head_dim or spec.hidden // spec.num_heads
    heads = {"q": (spec.num_heads, dqk), "k": (spec.kv_heads, dqk), "v": (spec.kv_heads, spec.v_head_dim or dqk)}
    q, k, v = (torch.randn(1, 4, h, d, dtype=torch.bfloat16, requires_grad=True) for h, d in heads.values())
    out = ulysses_attention(q, k, v, CAUSAL, group=types.SimpleNamespace(size=sp))
    forward = counter.bytes
    out.float().sum().backward()
    assert counter.bytes == 2 * forward
    assert priced(spec, 4 * sp, sp, Recompute())[1] == pytest.approx(counter.bytes, rel=1e-6)


class CountingShift:
    """`comm.RingShift` counting its steps and bytes; what arrives is what was sent."""

    count = 0
    bytes = 0

    def __init__(self, tensor, send_to, recv_from, group):
        CountingShift.count += 1
        CountingShift.bytes += tensor.numel() * tensor.element_size()
        self.received = tensor.clone()

    def wait(self):
        return self.received


@pytest.mark.parametrize("r", [2, 4])
def test_ring_charges_a_latency_per_point_to_point_step_the_runtime_makes(monkeypatch, r):
    monkeypatch.setattr(ring, "RingShift", CountingShift)
    CountingShift.count = 0
    q, k, v = (torch.randn(1, LOCAL, 4, 8, requires_grad=True) for _ in range(3))
    peers = ring.RingPeers(group=None, ranks=tuple(range(r)), index=0)
    out = ring.ring_attention(q, k, v, CAUSAL, peers, None, LOCAL * r)
    forward = CountingShift.count
    out.sum().backward()
    assert (forward, CountingShift.count - forward) == (r - 1, 2 * r - 1)  # blocks; blocks and accumulators
    spec = reference_adapter(Llama(LlamaConfig(vocab_size=64, hidden=32, num_layers=LAYERS, num_heads=4))).spec

    def steps(latency: float) -> float:
        cluster = ClusterSpec(world_size=r, gpus_per_node=r, intra_bw=1e30, inter_bw=1e30, intra_latency=latency)
        return split_time(spec, cluster, 1, r, float(LOCAL * r), 1e4, 1e-9).ring_p2p

    assert (steps(LATENCY) - steps(0.0)) / LATENCY == pytest.approx(3 * r - 2, rel=1e-6)


@pytest.mark.parametrize(("u", "r"), [(1, 2), (1, 4), (2, 2), (4, 2)])
def test_ring_and_its_ulysses_are_priced_at_the_bytes_they_move(monkeypatch, u, r):
    """Llama 3.1 8B's heads at Ulysses u x ring r: the key / value blocks the ring sends (bf16)
    and the fp32 accumulators its backward sends, and the Ulysses all-to-alls around it; with
    no attention work to hide the sends under, the price is every byte over the link."""
    spec = MODEL_PRESETS["llama-8b"]
    monkeypatch.setattr(ring, "RingShift", CountingShift)
    CountingShift.bytes = 0
    counter = counting(monkeypatch)
    local, dh = 4, spec.hidden // spec.num_heads
    q = torch.randn(1, local, spec.num_heads, dh, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, local, spec.kv_heads, dh, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    peers = ring.RingPeers(group=None, ranks=tuple(range(r)), index=0)
    out = ulysses_attention(q, k, v, AttnPattern("causal"), group=types.SimpleNamespace(size=u), ring=peers)
    out.float().sum().backward()
    n = float(local * u * r)  # the micro-batch's tokens
    price = split_time(spec, cluster(u * r, 0.0, 1.0), u, r, n, 0.0, 1e-9)
    assert price.ring_p2p == pytest.approx(CountingShift.bytes, rel=1e-6)
    assert price.all_to_all * u / max(u - 1, 1) == pytest.approx(counter.bytes, rel=1e-6)
