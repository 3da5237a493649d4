"""Whether a shard block's gradients may stay whole between its micro-batches.

With shard blocks (``shard_size`` s > 1) FSDP reduce-scatters every micro-batch's gradients
into the rank's fp32 shard: one reduce-scatter of the model per micro-batch. With its gradient
sync off until the step's last micro-batch (`runtime.sharded.ShardedGrads.set_accumulate_unsharded`)
the gradients accumulate whole and are reduce-scattered once per step, at the price of
holding them: 4 bytes a parameter per rank (`cost.base.unsharded_grad_bytes`) for the whole
step, on top of the sharded states. `hold_unsharded_grads` takes that price only when it
leaves room for the epoch: the largest sample alone on the widest SP group and the smallest
alone on the narrowest, with full recomputation, still fit the memory budget with it (the
test `cost.auto_shard` applies to the shard size itself).
"""

from __future__ import annotations

from collections.abc import Sequence

from dcparallel.cost.auto_shard import smallest_need
from dcparallel.cost.base import CostModel, unsharded_grad_bytes
from dcparallel.spec import ClusterSpec, ModelSpec, Size, format_bytes
from dcparallel.topology import Topology


def hold_unsharded_grads(
    cost: CostModel, model: ModelSpec, cluster: ClusterSpec, sizes: Sequence[Size]
) -> tuple[bool, str]:
    """(hold the gradients whole between micro-batches?, the sentence that says why) for
    ``cost`` priced at ``cluster.shard_size`` and the epoch's ``sizes``. Never at shard size 1
    (the replicated path accumulates into its own buffer and syncs once per step anyway)."""
    s = cluster.shard_size
    if s == 1:
        return False, "shard_size 1: gradients accumulate in the replicated buffer, synced once per step"
    if not sizes:
        return False, "no samples to check the memory with: gradients reduce-scattered every micro-batch"
    top = Topology.of(cluster, model.num_heads)
    extra = unsharded_grad_bytes(model)
    smallest, largest = min(sizes, key=model.tokens), max(sizes, key=model.tokens)
    need = max(smallest_need(cost, smallest, top.sizes[0]), smallest_need(cost, largest, top.sizes[-1])) + extra
    budget = float(cluster.memory_bytes)
    verdict = "fit" if need <= budget else "do not fit"
    why = (
        f"whole fp32 gradients held between micro-batches ({format_bytes(extra)} per rank) with the largest "
        f"sample alone at full recomputation need {format_bytes(need)}: they {verdict} the memory budget "
        f"{format_bytes(budget)}"
    )
    if need <= budget:
        return True, f"{why}; one reduce-scatter per step instead of one per micro-batch"
    return False, f"{why}; gradients reduce-scattered every micro-batch"
