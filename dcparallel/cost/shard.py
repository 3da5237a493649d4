"""What parameter-shard blocks cost a micro-batch (the smallest block size that fits:
`cost.auto_shard`).

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

from dataclasses import dataclass

import numpy as np

from dcparallel.cost.base import block_collective_time
from dcparallel.spec import ClusterSpec, ModelSpec


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
        return ShardComm(
            ag_layer=block_collective_time(cluster, 2.0 * layer),
            rs_layer=block_collective_time(cluster, 4.0 * layer),
            ag_root=block_collective_time(cluster, 2.0 * root),
            rs_root=block_collective_time(cluster, 4.0 * root),
        )

    def exposed(self, compute_per_layer: float, num_layers: int) -> float:
        """Seconds the block's collectives add to one micro-batch whose layers each compute
        ``compute_per_layer`` seconds forward + backward (the module docstring)."""
        return self._exposed(compute_per_layer, num_layers, max)

    def exposed_many(self, compute_per_layer: np.ndarray, num_layers: int) -> np.ndarray:
        """`exposed` elementwise, by the same operations."""
        return self._exposed(compute_per_layer, num_layers, np.maximum)

    def _exposed(self, c, num_layers: int, maximum):
        ag, rs = self.ag_layer, self.rs_layer
        if ag == 0.0 and rs == 0.0 and self.ag_root == 0.0:
            return np.zeros_like(c) if isinstance(c, np.ndarray) else 0.0
        per_layer = maximum(0.0, ag - c / 3.0) + maximum(0.0, ag + rs - 2.0 * c / 3.0)
        return num_layers * per_layer + 2.0 * ag + self.ag_root + self.rs_root
