"""Pricing the split of an SP group into Ulysses degree u x ring degree r (`runtime.ring`).

Per layer (forward + backward) and rank, for a micro-batch of ``n`` tokens with ``pairs``
attention query-key pairs on a group of k = u r ranks:

- **Ulysses** over u: the all-to-alls of q, k, v and the output (`a2a_hidden_units` at u),
  forward and backward, over the sub-group's link (`base.alltoall_time`), not overlapped:
  the link's latency once per call (`ULYSSES_CALLS`: two forward, two backward);
- **ring** over r: each step sends one key/value block of n / r tokens at the rank's
  (repeated) key/value heads / u, overlapped with that step's block attention (pairs / k of
  the attention work, split over r steps): a step costs the link's latency plus whatever
  of its transfer the compute does not hide. Forward r - 1 block steps; backward r - 1
  block steps with the fp32 gradient accumulators beside them, hidden under twice the
  forward's compute, and the accumulators' last step exposed whole. A ring of ranks that
  spans nodes steps at the inter-node link's speed (every rank waits for the slowest hop).

- **ring's merges**: after each of its r - 1 later steps a rank folds the step's partial
  output into the running one through their log-sum-exps (fp32: the two outputs read, one
  written), and in backward adds the step's dQ to its own and dK, dV to the visiting
  accumulator (fp32, read and written): memory-bound work on the compute stream, priced at
  `MERGE_BYTES_PER_S`. This is what makes ring lose to Ulysses on NVLink at short and
  medium lengths, as measured in public threads (8 x H200, 64k tokens: Ulysses -8% / +1%,
  ring -29% / -32% of the one-GPU throughput at degree 2 / 4, prime-rl#2418).

The attention's own work is the same for every split (zigzag balances the causal work), so
the split predicted fastest is the one of least exposed time (`best_split`; `least_comm`:
the same choice for arrays of micro-batches, value for value). Recomputing the attention
sub-block repeats its forward share (`SplitTime.forward`). The block attention is priced as
a fused kernel would run it. Pure python and numpy.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from dcparallel.cost.base import alltoall_time
from dcparallel.cost.heads import ULYSSES_CALLS, a2a_hidden_units, kv_heads_sent
from dcparallel.spec import ClusterSpec, ModelSpec
from dcparallel.topology import Topology

#: memory bandwidth the ring's merges run at: an H200's HBM3e, 4.8 TB/s on its datasheet
#: (not measured here), taken at 80% as the link speeds are derated (`spec.h200_cluster`)
MERGE_BYTES_PER_S = 0.8 * 4.8e12


class SplitTime(NamedTuple):
    """Exposed communication of one attention sub-block, forward + backward (seconds)."""

    ulysses: int
    ring: int
    all_to_all: float
    ring_p2p: float
    #: the ring's merges of partial outputs and gradients (memory-bound, not overlapped)
    ring_merge: float
    #: the forward's share of the three: what recomputing the sub-block repeats
    forward: float

    @property
    def seconds(self) -> float:
        return self.all_to_all + self.ring_p2p + self.ring_merge


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


def split_time(model: ModelSpec, cluster: ClusterSpec, u: int, r: int, n, pairs, attn_s_per_pair: float) -> SplitTime:
    """`SplitTime` of split (u, r) for ``n`` tokens and ``pairs`` attention pairs, with
    ``attn_s_per_pair`` seconds of attention work per pair and layer (forward + backward:
    a third forward, two thirds backward). ``n`` and ``pairs`` are floats, or arrays of many
    micro-batches (the times then arrays, by the same operations)."""
    k = u * r
    act_bytes = n / k * model.hidden * model.bytes_per_value
    a2a = 0.0 * n
    if u > 1:  # the bytes of the hidden-sized units, a latency per call (`ULYSSES_CALLS`)
        t, lat = alltoall_time(cluster, u, act_bytes), alltoall_time(cluster, u, 0.0 * act_bytes)
        a2a = 2 * (a2a_hidden_units(model, u) * (t - lat) + ULYSSES_CALLS * lat)
    if r == 1:
        return SplitTime(u, r, a2a, 0.0 * n, 0.0 * n, a2a / 2)
    pos = np.maximum if isinstance(n, np.ndarray) else max
    latency, bw = _link(cluster, k)
    block = kv_block_bytes(model, n, u, r)
    fwd_step = pairs / k * attn_s_per_pair / 3 / r  # one step's block attention, forward
    send = block / bw
    acc = block * 4 / model.bytes_per_value / bw  # the fp32 dK, dV accumulators
    forward = (r - 1) * (latency + pos(send - fwd_step, 0.0))
    backward = (r - 1) * (2 * latency + pos(send + acc - 2 * fwd_step, 0.0)) + latency + acc
    merge_fwd, merge_bwd = merge_bytes(model, n, u, r)
    merge = (r - 1) * (merge_fwd + merge_bwd) / MERGE_BYTES_PER_S
    return SplitTime(u, r, a2a, forward + backward, merge, a2a / 2 + forward + (r - 1) * merge_fwd / MERGE_BYTES_PER_S)


def merge_bytes(model: ModelSpec, n, u: int, r: int):
    """(forward, backward) fp32 bytes one later ring step's merges move on a rank holding
    n / r tokens of H / u query heads: forward the running and the new output read and the
    running one written (the log-sum-exps are a head size smaller); backward dQ read and
    written, and the visiting dK, dV accumulator read and written."""
    dqk = model.head_dim or model.hidden / model.num_heads
    dv = model.v_head_dim or dqk
    rows = n / r * model.num_heads / u
    kv = n / r * kv_heads_sent(model.kv_heads, u) / u
    return 3 * 4 * rows * dv, 2 * 4 * (rows * dqk + kv * (dqk + dv))


@functools.lru_cache(maxsize=1024)
def _splits(cluster: ClusterSpec, num_heads: int, sp: int) -> list[tuple[int, int]]:
    """`Topology.splits` of a size, refused (ValueError) where it has none."""
    splits = Topology.of(cluster, num_heads, ring=True).splits(sp)
    if not splits:
        raise ValueError(
            f"no Ulysses x ring split of an SP group of {sp} ranks fits a world of "
            f"{cluster.world_size} ({cluster.gpus_per_node} GPUs per node)"
        )
    return splits


def best_split(
    model: ModelSpec, cluster: ClusterSpec, sp: int, n: float, pairs: float, attn_s_per_pair: float
) -> SplitTime:
    """The split of a group of ``sp`` ranks with the least exposed communication, among the
    topology's (`Topology.splits`); ties go to the larger Ulysses degree."""
    times = [
        split_time(model, cluster, u, r, n, pairs, attn_s_per_pair) for u, r in _splits(cluster, model.num_heads, sp)
    ]
    return min(times, key=lambda t: (t.seconds, -t.ulysses))


def least_comm(model: ModelSpec, cluster: ClusterSpec, sp: int, n, pairs, attn_s_per_pair: float):
    """(seconds, forward seconds) of `best_split`'s split of a group of ``sp`` ranks, for
    floats or arrays of micro-batches (elementwise, each its own split): the least
    `SplitTime.seconds`, ties to the larger Ulysses degree, and that split's forward."""
    best = None
    # the larger Ulysses degree first: a later split must be strictly faster to replace it
    for u, r in reversed(_splits(cluster, model.num_heads, sp)):
        t = split_time(model, cluster, u, r, n, pairs, attn_s_per_pair)
        if best is None:
            best = (t.seconds, t.forward)
        elif isinstance(n, np.ndarray):
            take = t.seconds < best[0]
            best = (np.where(take, t.seconds, best[0]), np.where(take, t.forward, best[1]))
        elif t.seconds < best[0]:
            best = (t.seconds, t.forward)
    return best


def layer_comm(model: ModelSpec, cluster: ClusterSpec, n_tok, pairs, sp, attn_s_per_pair: float, array: bool):
    """Per layer, the exposed communication of the attention sub-blocks (forward + backward,
    and the forward alone) of micro-batches of ``n_tok`` tokens and ``pairs`` pairs at their
    best split of ``sp`` ranks (`least_comm`); ``array``: arrays of shape (micro-batches, 1)
    and ``sp`` of shape (1, degrees), the results of shape (micro-batches, degrees)."""
    per = model.attn_per_layer
    if not array:
        comm, fwd = least_comm(model, cluster, sp, n_tok, pairs, attn_s_per_pair)
        return per * comm, per * fwd
    cols = [least_comm(model, cluster, int(k), n_tok[:, 0], pairs[:, 0], attn_s_per_pair) for k in sp.ravel()]
    return per * np.stack([c for c, _ in cols], axis=1), per * np.stack([f for _, f in cols], axis=1)


def check_ring(model: ModelSpec, cluster: ClusterSpec) -> None:
    """Refuses ring on a cluster (`ClusterSpec.ring`) for a model it cannot run: factorized
    spatial / temporal attention attends within a frame or across frames at one place, and a
    frame is not a ring block."""
    if cluster.ring and model.attention == "factorized":
        raise ValueError(
            f"{model.name}'s factorized spatial / temporal attention cannot run under ring attention "
            f"(a frame is not a ring block); plan it with ClusterSpec(ring=False)"
        )
