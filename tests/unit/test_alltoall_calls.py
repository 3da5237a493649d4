"""The analytic cost model charges a link's latency once per all-to-all call the runtime makes.

A tiny reference Llama runs one forward and backward at SP 2 through the runtime's own
attention (`runtime.ulysses.UlyssesAttention`) and recompute wrappers (`runtime.recompute`),
with `torch.distributed` inside `runtime.comm` swapped for a counter of ``all_to_all_single``
calls (its output a copy of its input: the shapes are the real ones, the values are not
checked). Ring attention's point-to-point steps are counted likewise (`comm.RingShift`
swapped for a counter). The cost model's count is read off its prices: a cluster with link
latency and unbounded bandwidth against the same without latency, per layer and per unit of
``latency * (sp - 1)`` (`cost.base.alltoall_time`)."""

from __future__ import annotations

import types

import pytest
import torch

from dcparallel.adapters.reference import adapter as reference_adapter
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.ring import split_time
from dcparallel.models.llama import CAUSAL, Llama, LlamaConfig
from dcparallel.runtime import comm, ring
from dcparallel.runtime.recompute import LayerRecompute
from dcparallel.runtime.ulysses import UlyssesAttention
from dcparallel.spec import ClusterSpec, Recompute

SP, LAYERS, LOCAL = 2, 2, 16
LATENCY = 1e-3


class CountingDist:
    """`torch.distributed` as `runtime.comm` uses it in Ulysses attention, counting calls."""

    def __init__(self):
        self.calls = 0

    def get_world_size(self, group=None):
        return group.size

    def get_rank(self, group=None):
        return 0

    def all_to_all_single(self, out, x, group=None):
        self.calls += 1
        out.copy_(x)


def runtime_calls(monkeypatch, recompute: Recompute) -> tuple[float, float]:
    """All-to-all calls per layer of one micro-batch at SP 2: (forward, backward)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, hidden=32, num_layers=LAYERS, num_heads=4, ffn_hidden=48))
    ad = reference_adapter(model)
    attention = UlyssesAttention()
    ad.install_attention(attention)
    LayerRecompute(ad, attention).set(recompute)
    counter = CountingDist()
    monkeypatch.setattr(comm, "dist", counter)
    monkeypatch.setattr(comm, "is_distributed", lambda: True)
    attention.activate(types.SimpleNamespace(size=SP), None)
    positions = torch.arange(LOCAL)[None]  # rank 0's shard of a row of SP * LOCAL tokens
    logits = model(torch.randint(0, 64, (1, LOCAL)), positions)
    forward = counter.calls
    logits.float().pow(2).mean().backward()
    return forward / LAYERS, (counter.calls - forward) / LAYERS


def charged_calls(spec, recompute: Recompute) -> float:
    """Latencies the analytic model charges per layer of that micro-batch at SP 2."""

    def price(latency: float) -> float:
        cluster = ClusterSpec(
            world_size=SP,
            gpus_per_node=SP,
            memory_bytes=2**34,
            intra_bw=1e30,
            inter_bw=1e30,
            intra_latency=latency,
            inter_latency=latency,
            name="cpu",
        )
        return AnalyticCost(spec, cluster).terms((SP * LOCAL,), SP).time(recompute)

    return (price(LATENCY) - price(0.0)) / LAYERS / (LATENCY * (SP - 1))


@pytest.mark.parametrize("recompute", [Recompute(0, 0), Recompute(LAYERS, 0)], ids=["kept", "attention recomputed"])
def test_the_cost_model_charges_a_latency_per_all_to_all_call_the_runtime_makes(monkeypatch, recompute):
    forward, backward = runtime_calls(monkeypatch, recompute)
    assert forward == 2  # q, k, v together; the output back
    assert backward == (4 if recompute.attn else 2)  # the recomputed forward's two, then both mirrored
    spec = reference_adapter(Llama(LlamaConfig(vocab_size=64, hidden=32, num_layers=LAYERS, num_heads=4))).spec
    assert charged_calls(spec, recompute) == pytest.approx(forward + backward, rel=1e-6)


class CountingShift:
    """`comm.RingShift` counting its steps; what arrives is what was sent."""

    count = 0

    def __init__(self, tensor, send_to, recv_from, group):
        CountingShift.count += 1
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
