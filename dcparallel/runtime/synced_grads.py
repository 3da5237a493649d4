"""Reading and clipping the step's synced gradients of a `runtime.grad_sync.GradSync`.

Replicated (a plain torch optimizer, or one rank): every rank holds the whole summed
gradient, so the norm needs no communication. Sharded (ZeRO-1 with more than one rank,
``GradSync.sharded``): a rank holds the sum of its own shard only, so the norm combines the
shards' partial norms in one scalar all-reduce (sums of p-th powers in fp64; the maximum for
the inf norm) and each rank scales its shard, which is all its optimizer reads; whole
gradients come from an all-gather of the shards (`gathered`, collective).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dcparallel.runtime import comm

if TYPE_CHECKING:
    from dcparallel.runtime.grad_sync import GradSync


def _require_synced(gs: GradSync, what: str) -> None:
    if not gs.synced:
        raise RuntimeError(
            f"call dc.sync_gradients() before {what}: the step's gradients have not been summed over the ranks yet"
        )


def _group(gs: GradSync):
    return gs.group if gs.group is not None else comm.world_group()


def grad_norm(gs: GradSync, norm_type: float = 2.0) -> Tensor:
    """The global ``norm_type`` norm of the synced gradients, as `torch.nn.utils.get_total_norm`
    of every parameter's gradient (a 0-d tensor on the gradients' device). Collective when
    ``gs.sharded``."""
    norm_type = float(norm_type)
    if not gs.sharded:
        return torch.nn.utils.get_total_norm(gs.views, norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_ of ZeRO-1 shards supports norm types > 0 and inf; got {norm_type}")
    lo = min(gs.rank * gs.shard_numel, gs.numel)
    mine = gs.flat_grad[lo : min(lo + gs.shard_numel, gs.numel)]  # the padding is no gradient
    if math.isinf(norm_type):
        t = mine.abs().max() if mine.numel() else mine.new_zeros(())
        return comm.all_reduce_(t.reshape(1).clone(), _group(gs), "max")[0]
    # the shard's norm without a copy (fp32, as torch's); its p-th power summed over the shards in fp64
    t = torch.linalg.vector_norm(mine, norm_type).double().pow(norm_type).reshape(1)
    return comm.all_reduce_(t, _group(gs))[0].pow(1.0 / norm_type).float()


def clip_grad_norm_(gs: GradSync, max_norm: float, norm_type: float = 2.0) -> float:
    """Scales the synced gradients by ``min(1, max_norm / (norm + 1e-6))`` with the global
    norm (`grad_norm`), as `torch.nn.utils.clip_grad_norm_`; returns the norm before clipping.
    Collective when ``gs.sharded``."""
    _require_synced(gs, "dc.clip_grad_norm_()")
    norm = grad_norm(gs, norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if gs.sharded:
        gs.owned_grad().mul_(coef)
    else:
        gs.flat_grad[: gs.numel].mul_(coef)
        gs.expose_grads()  # low-precision p.grad copies (if any) follow the scaled buffer
    return float(norm)


def gathered(gs: GradSync) -> list[Tensor]:
    """Every trainable parameter's whole synced gradient (fp32 copies, parameter order). When
    ``gs.sharded`` the ranks' shards are all-gathered: collective, every rank calls it."""
    _require_synced(gs, "reading the gradients")
    if not gs.sharded:
        return [v.detach().clone() for v in gs.views]
    flat = comm.all_gather_flat(gs.owned_grad(), _group(gs))
    parts = flat[: gs.numel].split([v.numel() for v in gs.views])
    return [g.view_as(v) for g, v in zip(parts, gs.views, strict=True)]
