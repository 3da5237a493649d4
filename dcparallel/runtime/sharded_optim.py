"""`ShardedAdamW`: AdamW for parameters sharded in blocks (`runtime.sharded`), its fp32 state
sharded over the whole world.

Rank r holds shard ``r % s`` of every parameter (its block's FSDP shard): ``local`` elements,
laid out one parameter after the other in ``ShardedGrads.flat_grad``. The W/s replicas of that
shard (one rank per block) split it once more: replica j owns elements ``[j*m, (j+1)*m)``
(m = ceil(local / replicas)) and keeps both fp32 moments of those only, so each rank holds
8 bytes of optimizer state per P/W parameters (ZeRO-1 over the replicas on top of the block
shard). The sharded parameters themselves are fp32 (`runtime.sharded`), so they are the
master weights: a step reads the owned piece out of them, updates it, and the replicas
all-gather their pieces back into the block shard of the parameters.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from dcparallel.cost.base import STEP_CHUNK_NUMEL
from dcparallel.runtime import comm
from dcparallel.runtime.zero import Owned, adamw_step_, decay_ranges

if TYPE_CHECKING:
    from dcparallel.runtime.sharded import ShardedGrads

_STATE = ("exp_avg", "exp_avg_sq")


class ShardedAdamW(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` (one param group holding the model's trainable parameters:
    ``lr``, ``betas``, ``eps``, ``weight_decay``; torch's LR schedulers drive ``lr``) whose
    update is torch.optim.AdamW's with decoupled weight decay on matrices (dim >= 2) only, as
    `runtime.zero.ZeroAdamW`. ``grads``: the engine's `ShardedGrads`. `step` needs the step's
    synced gradients (`Engine.sync_gradients`) and is collective over the replicas."""

    def __init__(
        self,
        grads: ShardedGrads,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if not lr >= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0 or not weight_decay >= 0:
            raise ValueError(f"bad AdamW settings lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        super().__init__(grads.params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.grads = grads
        m = grads.piece_numel
        self._lo = grads.replica_index * m
        self._hi = self._lo + m
        device = grads.device
        with torch.no_grad():
            self._locals = [p.to_local().view(-1) for p in grads.params]  # views of FSDP's shard storage
        self._starts = [a for a, _ in grads.ranges]
        self.decay_ranges = decay_ranges(grads.params, self._lo, self._hi, sizes=[n.numel() for n in self._locals])
        self.exp_avg = torch.zeros(m, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.num_steps = 0

    def _copy(self, lo: int, hi: int, buf: torch.Tensor, to_params: bool) -> None:
        """Elements ``[lo, hi)`` of this rank's parameter shards laid end to end (the layout of
        ``flat_grad``) into ``buf`` (``to_params``: from ``buf`` into the shards); the
        padding past the last parameter is left alone."""
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        for local, (a, b) in zip(self._locals[i:], self.grads.ranges[i:]):
            if a >= hi:
                break
            x, y = max(a, lo), min(b, hi)
            if x < y:
                if to_params:
                    local[x - a : y - a].copy_(buf[x - lo : y - lo])
                else:
                    buf[x - lo : y - lo].copy_(local[x - a : y - a])

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of this rank's piece, `STEP_CHUNK_NUMEL` elements at a time: the
        chunk is read out of the fp32 parameter shards (the master weights), updated, and the
        replicas all-gather their chunks in place into one buffer, copied back into the shards.
        Temporaries: that buffer (one chunk per replica) and the update's denominator
        (`cost.base.state_recipe`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.grads.synced:
            raise RuntimeError(
                "call dc.sync_gradients() before optimizer.step(): the gradients of this step "
                "have not been summed over the ranks yet"
            )
        group = self.param_groups[0]
        lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        self.num_steps += 1
        g = self.grads.flat_grad[self._lo : self._hi]

        def update(chunk: torch.Tensor, c0: int, c1: int) -> None:
            adamw_step_(
                chunk,
                g[c0:c1],
                self.exp_avg[c0:c1],
                self.exp_avg_sq[c0:c1],
                self.decay_ranges,
                offset=c0,
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=wd,
                step=self.num_steps,
            )

        self._by_chunks(update)
        return loss

    def owned(self) -> list[Owned]:
        """What this rank owns of each trainable parameter (`Owned`): the part of its replica
        piece in the parameter's block shard, placed in the whole parameter (FSDP2 cuts dim 0
        as ``torch.chunk`` does); the master values are views of the shard itself."""
        from torch.distributed.tensor import Shard

        gr, out = self.grads, []
        for i, (p, local, (a, b)) in enumerate(zip(gr.params, self._locals, gr.ranges, strict=True)):
            shape = tuple(p.shape)
            inner = math.prod(shape[1:])
            row0 = min(gr.shard_index * math.ceil(shape[0] / gr.shard_size), shape[0])
            local_shape = tuple(p.to_local().shape)
            assert tuple(p.placements) == (Shard(0),) and local_shape[1:] == shape[1:], (i, p.placements, local_shape)
            assert row0 + local_shape[0] <= shape[0], (i, row0, local_shape)
            x, y = max(a, self._lo), min(b, self._hi)
            if x < y:
                moments = [t[x - self._lo : y - self._lo] for t in (self.exp_avg, self.exp_avg_sq)]
                out.append(Owned(i, row0 * inner + x - a, row0 * inner + y - a, local[x - a : y - a], *moments))
        return out

    def sync_replicas(self) -> None:
        """Every replica's piece of the parameter shards (e.g. just loaded) into the other
        replicas' shards. Collective over the replicas."""
        with torch.no_grad():
            self._by_chunks(None)

    def _by_chunks(self, update) -> None:
        """For each `STEP_CHUNK_NUMEL` elements of this rank's piece: read them out of the
        parameter shards, ``update(chunk, start, stop)`` them in place (None: leave them), and
        all-gather every replica's chunk in place into one buffer, copied back into the shards."""
        gr, m = self.grads, self.grads.piece_numel
        replicas, j = gr.num_replicas, gr.replica_index
        buf = torch.empty(replicas * min(m, STEP_CHUNK_NUMEL), dtype=torch.float32, device=gr.device)
        for c0 in range(0, m, STEP_CHUNK_NUMEL):
            c1 = min(m, c0 + STEP_CHUNK_NUMEL)
            n = c1 - c0
            gathered = buf[: replicas * n]
            chunk = gathered[j * n : (j + 1) * n]
            chunk.zero_()
            self._copy(self._lo + c0, self._lo + c1, chunk, to_params=False)
            if update is not None:
                update(chunk, c0, c1)
            comm.all_gather_shards_(gathered, n, gr.replica_group)  # None: one block
            for k in range(replicas):
                self._copy(k * m + c0, k * m + c1, gathered[k * n : (k + 1) * n], to_params=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts a new step's accumulation (the gradient shards stay views of the flat
        buffer, zeroed, whatever ``set_to_none`` says)."""
        self.grads.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """torch's (param groups) plus this rank's piece of the moments and where it lies (the
        master weights are the parameters: the model's state dict)."""
        sd = super().state_dict()
        gr = self.grads
        sd["shard"] = {
            "num_steps": self.num_steps,
            "world_size": gr.world_size,
            "shard_size": gr.shard_size,
            "rank": gr.rank,
            "local_numel": gr.local_numel,
            "start": self._lo,
            "stop": self._hi,
            **{k: getattr(self, k).detach().clone() for k in _STATE},
        }
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a state saved by this rank at the same world size and shard size (resharding
        a sharded optimizer state is not implemented: it is refused). Collective."""
        shard = state_dict.get("shard")
        gr = self.grads
        want = {
            "world_size": gr.world_size,
            "shard_size": gr.shard_size,
            "rank": gr.rank,
            "local_numel": gr.local_numel,
        }
        if shard is None or any(shard.get(k) != v for k, v in want.items()):
            got = None if shard is None else {k: shard.get(k) for k in want}
            raise ValueError(
                f"this optimizer state was saved as {got}, this rank is {want}; a ShardedAdamW state "
                f"loads only at the same world size, shard size and rank"
            )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "shard"})
        self.num_steps = int(shard["num_steps"])
        for k in _STATE:
            getattr(self, k).copy_(shard[k])
