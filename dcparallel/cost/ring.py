"""Pricing the split of an SP group into Ulysses degree u x ring degree r (`runtime.ring`).

Per layer (forward + backward) and rank, for a micro-batch of ``n`` tokens with ``pairs``
attention query-key pairs on a group of k = u r ranks:

- **Ulysses** over u: the all-to-alls of q, k, v and the output (`a2a_hidden_units` at u),
  forward and backward, over the sub-group's link (`base.alltoall_time`), not overlapped;
- **ring** over r: each step sends one key/value block of n / r tokens at the rank's
  (repeated) key/value heads / u, overlapped with that step's block attention (pairs / k of
  the attention work, split over r steps): a step costs the link's latency plus whatever
  of its transfer the compute does not hide. Forward r - 1 block steps; backward r - 1
  block steps with the fp32 gradient accumulators beside them, hidden under twice the
  forward's compute, and the accumulators' last step exposed whole. A ring of ranks that
  spans nodes steps at the inter-node link's speed (every rank waits for the slowest hop).

Compute is the same for every split (zigzag balances the causal work), so the split
predicted fastest is the one of least exposed communication (`best_split`). Pure python.
"""

from __future__ import annotations

from typing import NamedTuple

from dcparallel.cost.base import alltoall_time
from dcparallel.cost.heads import a2a_hidden_units, kv_heads_sent
from dcparallel.spec import ClusterSpec, ModelSpec
from dcparallel.topology import Topology


class SplitTime(NamedTuple):
    """Exposed communication of one attention sub-block, forward + backward (seconds)."""

    ulysses: int
    ring: int
    all_to_all: float
    ring_p2p: float

    @property
    def seconds(self) -> float:
        return self.all_to_all + self.ring_p2p


def _link(cluster: ClusterSpec, sp: int) -> tuple[float, float]:
    """(latency, bandwidth) of a ring step among the ranks of a group of ``sp``."""
    if cluster.spans_nodes(sp):
        return cluster.inter_latency, cluster.inter_bw
    return cluster.intra_latency, cluster.intra_bw


def kv_block_bytes(model: ModelSpec, n: float, u: int, r: int) -> float:
    """Bytes of one ring step's key/value block: n / r tokens of the rank's K and V heads."""
    dqk = model.head_dim or model.hidden / model.num_heads
    dv = model.v_head_dim or dqk
    return n / r * kv_heads_sent(model.kv_heads, u) / u * (dqk + dv) * model.bytes_per_value


def split_time(model: ModelSpec, cluster: ClusterSpec, u: int, r: int, n: float, pairs: float,
               attn_s_per_pair: float) -> SplitTime:
    """`SplitTime` of split (u, r) for ``n`` tokens and ``pairs`` attention pairs, with
    ``attn_s_per_pair`` seconds of attention work per pair and layer (forward + backward:
    a third forward, two thirds backward)."""
    k = u * r
    act_bytes = n / k * model.hidden * model.bytes_per_value
    a2a = 2 * a2a_hidden_units(model, u) * alltoall_time(cluster, u, act_bytes) if u > 1 else 0.0
    if r == 1:
        return SplitTime(u, r, a2a, 0.0)
    latency, bw = _link(cluster, k)
    block = kv_block_bytes(model, n, u, r)
    fwd_step = pairs / k * attn_s_per_pair / 3 / r  # one step's block attention, forward
    send = block / bw
    acc = block * 4 / model.bytes_per_value / bw  # the fp32 dK, dV accumulators
    forward = (r - 1) * (latency + max(0.0, send - fwd_step))
    backward = (r - 1) * (2 * latency + max(0.0, send + acc - 2 * fwd_step)) + latency + acc
    return SplitTime(u, r, a2a, forward + backward)


def best_split(model: ModelSpec, cluster: ClusterSpec, sp: int, n: float, pairs: float,
               attn_s_per_pair: float) -> SplitTime:
    """The split of a group of ``sp`` ranks with the least exposed communication, among the
    topology's (`Topology.splits`); ties go to the larger Ulysses degree."""
    splits = Topology.of(cluster, model.num_heads, ring=True).splits(sp)
    if not splits:
        raise ValueError(f"no Ulysses x ring split of an SP group of {sp} ranks fits a world of "
                         f"{cluster.world_size} ({cluster.gpus_per_node} GPUs per node)")
    times = [split_time(model, cluster, u, r, n, pairs, attn_s_per_pair) for u, r in splits]
    return min(times, key=lambda t: (t.seconds, -t.ulysses))
