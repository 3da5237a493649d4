"""What parameter-shard blocks cost a micro-batch, and the smallest block size that fits.

With a shard size s > 1 (`ClusterSpec.shard_size`) the ranks are cut into aligned blocks of
s; inside a block parameters and gradients are sharded (FSDP2), so every micro-batch, on every
rank of its group, all-gathers each layer's bf16 parameters before its forward and again before
its backward (which also serves recomputation: the layer's parameters are gathered while it
recomputes), and reduce-scatters the layer's fp32 gradient after its backward. The parameters
outside the repeated layers (embeddings, head) are one more unit, gathered once and
reduce-scattered once per micro-batch. All of it runs on the block's links
(`base.block_collective_time`).

FSDP2 prefetches the next layer's all-gather during the current layer's compute and runs
the reduce-scatter beside the next layer's backward, so per layer only what the compute
cannot hide is paid:

    per layer  = max(0, ag - c / 3) + max(0, ag + rs - 2 c / 3)
    per micro-batch = L * per layer + 2 ag + ag_root + rs_root

with c the layer's forward + backward compute (forward a third of it), ag / rs one layer's
all-gather / reduce-scatter; the first all-gather of the forward and of the backward and the
root unit's collectives are exposed. Recomputation lengthens the backward and hides more; it
is not credited (conservative, and it keeps a micro-batch's time linear in its recompute
counts). Adding work to a micro-batch never makes it faster (c + max(0, a - c / 3) grows with
c), and a short micro-batch pays nearly the whole gather: more, smaller micro-batches cost more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from dcparallel.cost.base import CostModel, block_collective_time
from dcparallel.spec import ClusterSpec, ModelSpec, Recompute, Size, format_bytes
from dcparallel.topology import Topology


@dataclass(frozen=True, slots=True)
class ShardComm:
    """Seconds of one shard block's collectives: a layer's and the root unit's."""

    ag_layer: float
    rs_layer: float
    ag_root: float
    rs_root: float

    @staticmethod
    def of(model: ModelSpec, cluster: ClusterSpec) -> ShardComm:
        layer = model.attn_params + model.mlp_params + model.other_params
        root = model.extra_params
        return ShardComm(ag_layer=block_collective_time(cluster, 2.0 * layer),
                         rs_layer=block_collective_time(cluster, 4.0 * layer),
                         ag_root=block_collective_time(cluster, 2.0 * root),
                         rs_root=block_collective_time(cluster, 4.0 * root))

    def exposed(self, compute_per_layer: float, num_layers: int) -> float:
        """Seconds the block's collectives add to one micro-batch whose layers each compute
        ``compute_per_layer`` seconds forward + backward (the module docstring)."""
        ag, rs, c = self.ag_layer, self.rs_layer, compute_per_layer
        if ag == 0.0 and rs == 0.0 and self.ag_root == 0.0:
            return 0.0
        per_layer = max(0.0, ag - c / 3.0) + max(0.0, ag + rs - 2.0 * c / 3.0)
        return num_layers * per_layer + 2.0 * ag + self.ag_root + self.rs_root


def _smallest_need(cost: CostModel, size: Size, sp: int) -> float:
    """Peak bytes of one sample alone at SP ``sp`` with full recomputation."""
    L = cost.model.num_layers
    return cost.terms((size,), sp).memory(Recompute(L, L))


def auto_shard_size(model: ModelSpec, cluster: ClusterSpec, sizes: Sequence[Size] | None = None, *,
                    make_cost: Callable[[ModelSpec, ClusterSpec], CostModel] | None = None) -> int:
    """``shard_size="auto"``: the smallest shard size (of `ClusterSpec.shard_sizes`) with which
    the model states and the smallest micro-batch fit the memory budget — the smallest sample of
    ``sizes`` alone on a group of s ranks with full recomputation — and with which the largest
    sample still fits some layout (alone on the widest SP group, full recomputation), so that
    the epoch can be planned. Without ``sizes`` only the model states (with the gathered
    parameters) must fit. ``make_cost`` builds the cost model for each candidate
    (default `AnalyticCost`). A ValueError names the model, the memory the largest shard size
    still needs and what is available, and the fixes."""
    if make_cost is None:
        from dcparallel.cost.analytic import AnalyticCost
        make_cost = AnalyticCost
    budget = float(cluster.memory_bytes)
    smallest = largest = None
    if sizes:
        smallest = min(sizes, key=model.tokens)
        largest = max(sizes, key=model.tokens)
    need, why, tried = 0.0, "", []
    candidates = cluster.shard_sizes()
    for s in candidates:
        c = dataclasses.replace(cluster, shard_size=s)
        try:
            top = Topology.of(c, model.num_heads)
        except ValueError:
            continue  # no SP group of at least s ranks divides the heads
        tried.append(s)
        cost = make_cost(model, c)
        need = cost.model_state_bytes()
        why = "its model states"
        if smallest is not None:
            need = _smallest_need(cost, smallest, top.sizes[0])
            why = f"its smallest sample ({smallest!r}) alone at SP {top.sizes[0]} with full recomputation"
        if need > budget:
            continue
        if largest is not None:
            need_l = _smallest_need(cost, largest, top.sizes[-1])
            if need_l > budget:
                need, why = need_l, f"its largest sample ({largest!r}) at SP {top.sizes[-1]} with full recomputation"
                continue
        return s
    if not tried:
        raise ValueError(f"model {model.name!r} has {model.num_heads} attention heads, which no SP group of at least "
                         f"the shard sizes {candidates} divides on this cluster; use a world or node size whose "
                         f"groups divide the heads")
    raise ValueError(
        f"model {model.name!r} ({model.num_params / 1e9:.2f}B parameters) does not fit {cluster.world_size} GPUs of "
        f"{format_bytes(budget)} usable memory at any shard size (tried {tried}): at shard size "
        f"{tried[-1]} {why} needs {format_bytes(need)} per rank. Use more GPUs (the optimizer states shrink "
        f"with the world, parameters and gradients with the shard size), GPUs with more memory, or shorter samples")
