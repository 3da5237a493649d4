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

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from dcparallel.runtime import comm

if TYPE_CHECKING:
    from dcparallel.runtime.sharded import ShardedGrads

_STATE = ("exp_avg", "exp_avg_sq")


class ShardedAdamW(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` (one param group holding the model's trainable parameters:
    ``lr``, ``betas``, ``eps``, ``weight_decay``; torch's LR schedulers drive ``lr``) whose
    update is torch.optim.AdamW's with decoupled weight decay on matrices (dim >= 2) only, as
    `runtime.zero.ZeroAdamW`. ``grads``: the engine's `ShardedGrads`. `step` needs the step's
    synced gradients (`Engine.sync_gradients`) and is collective over the replicas."""

    def __init__(self, grads: ShardedGrads, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        if not lr >= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0 or not weight_decay >= 0:
            raise ValueError(f"bad AdamW settings lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        super().__init__(grads.params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.grads = grads
        m = grads.piece_numel
        self._lo = grads.replica_index * m
        self._hi = self._lo + m
        device = grads.flat_grad.device
        self._decay = torch.zeros(m, dtype=torch.float32, device=device)
        with torch.no_grad():
            self._locals = [p.to_local().view(-1) for p in grads.params]  # views of FSDP's shard storage
        # (param's local view, its slice, the piece's slice) for every parameter overlapping the piece
        self._overlap: list[tuple[torch.Tensor, slice, slice]] = []
        for p, local, (a, b) in zip(grads.params, self._locals, grads._ranges, strict=True):
            x, y = max(a, self._lo), min(b, self._hi)
            if x < y:
                self._overlap.append((local, slice(x - a, y - a), slice(x - self._lo, y - self._lo)))
                if p.dim() >= 2:
                    self._decay[x - self._lo: y - self._lo] = 1.0
        self.exp_avg = torch.zeros(m, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.num_steps = 0

    def _read_piece(self) -> torch.Tensor:
        """This rank's piece of the (fp32) parameter shard, as one tensor (padding zero)."""
        piece = torch.zeros_like(self.exp_avg)
        for local, src, dst in self._overlap:
            piece[dst].copy_(local[src])
        return piece

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.grads.synced:
            raise RuntimeError("call dc.sync_gradients() before optimizer.step(): the gradients of this step "
                               "have not been summed over the ranks yet")
        group = self.param_groups[0]
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        self.num_steps += 1
        g = self.grads.flat_grad[self._lo: self._hi]
        master = self._read_piece()
        if wd:
            master.mul_(1 - lr * wd * self._decay)
        self.exp_avg.lerp_(g, 1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1 = 1 - b1**self.num_steps
        bc2 = 1 - b2**self.num_steps
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
        master.addcdiv_(self.exp_avg, denom, value=-lr / bc1)
        self._write_back(master)
        return loss

    def _write_back(self, piece: torch.Tensor) -> None:
        """Every replica's piece into this rank's block shard of the parameters."""
        out = comm.all_gather_flat(piece, self.grads.replica_group)  # None: one block
        for local, (a, b) in zip(self._locals, self.grads._ranges, strict=True):
            local.copy_(out[a:b])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts a new step's accumulation (the gradient shards stay views of the flat
        buffer, zeroed, whatever ``set_to_none`` says)."""
        self.grads.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """torch's (param groups) plus this rank's piece of the moments and where it lies (the
        master weights are the parameters: the model's state dict)."""
        sd = super().state_dict()
        gr = self.grads
        sd["shard"] = {"num_steps": self.num_steps, "world_size": gr.world_size, "shard_size": gr.shard_size,
                       "rank": gr.rank, "local_numel": gr.local_numel, "start": self._lo, "stop": self._hi,
                       **{k: getattr(self, k).detach().clone() for k in _STATE}}
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a state saved by this rank at the same world size and shard size (resharding
        a sharded optimizer state is not implemented: it is refused). Collective."""
        shard = state_dict.get("shard")
        gr = self.grads
        want = {"world_size": gr.world_size, "shard_size": gr.shard_size, "rank": gr.rank,
                "local_numel": gr.local_numel}
        if shard is None or any(shard.get(k) != v for k, v in want.items()):
            got = None if shard is None else {k: shard.get(k) for k in want}
            raise ValueError(f"this optimizer state was saved as {got}, this rank is {want}; a ShardedAdamW state "
                             f"loads only at the same world size, shard size and rank")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "shard"})
        self.num_steps = int(shard["num_steps"])
        for k in _STATE:
            getattr(self, k).copy_(shard[k])
