"""`ZeroAdamW`: AdamW with ZeRO-1 sharded fp32 state, and its resharding on load.

Rank r of a world of W owns elements ``[r*S, (r+1)*S)`` of the flat parameters, S =
ceil(numel / W). A saved shard names its range of the *unpadded* flat vector, so any set of
shards that covers ``[0, numel)`` can be loaded at any world size: each rank copies the parts
of the saved shards that overlap its new range (`load_state_dict` with a list of shards).

`ZeroAdamW` is a `torch.optim.Optimizer` with one parameter group (the engine's trainable
parameters): it reads ``lr``, ``betas``, ``eps`` and ``weight_decay`` from
``param_groups[0]`` at every step, so torch's learning-rate schedulers drive it. Its
``state_dict`` is this rank's shard (above), not torch's per-parameter format.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dcparallel.cost.base import STEP_CHUNK_NUMEL
from dcparallel.runtime import comm
from dcparallel.runtime.compat import unless_compiling

if TYPE_CHECKING:
    from dcparallel.runtime.grad_sync import GradSync

_STATE = ("master", "exp_avg", "exp_avg_sq")


def decay_ranges(
    params: Sequence[Tensor], lo: int, hi: int, sizes: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Where decoupled weight decay applies (matrices: dim >= 2) inside the flat range
    ``[lo, hi)`` of ``params`` laid out one after the other (``sizes``: the elements each
    takes there; default their numel), as ``(start, stop)`` offsets from ``lo``; adjacent
    matrices are merged into one range."""
    out: list[tuple[int, int]] = []
    off = 0
    for p, size in zip(params, sizes if sizes is not None else [p.numel() for p in params], strict=True):
        a, b = max(off, lo), min(off + size, hi)
        if p.dim() >= 2 and a < b:
            if out and out[-1][1] == a - lo:
                out[-1] = (out[-1][0], b - lo)
            else:
                out.append((a - lo, b - lo))
        off += size
    return out


def adamw_update_(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    step: int,
) -> None:
    """torch.optim.AdamW's moment update and parameter step (weight decay applied by the
    caller), in place, `STEP_CHUNK_NUMEL` elements at a time: the denominator, the one
    temporary, is a chunk, not a copy of the shard (`cost.base.state_recipe` counts it)."""
    b1, b2 = betas
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    for i in range(0, master.numel(), STEP_CHUNK_NUMEL):
        j = slice(i, i + STEP_CHUNK_NUMEL)
        g, m, v = grad[j], exp_avg[j], exp_avg_sq[j]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = v.sqrt().div_(math.sqrt(bc2)).add_(eps)
        master[j].addcdiv_(m, denom, value=-lr / bc1)
        del denom  # freed before the next chunk's is allocated


def adamw_step_(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    decay: Sequence[tuple[int, int]],
    *,
    offset: int = 0,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One AdamW step of ``master`` in place: decoupled weight decay (``lr * weight_decay``)
    on the parts of the ``decay`` ranges that fall in ``master`` (``master`` starts at
    ``offset`` of the coordinates the ranges are given in), then `adamw_update_`. Both
    optimizers step through it: `ZeroAdamW` its whole shard, `ShardedAdamW` a chunk."""
    n = master.numel()
    for a, b in decay if weight_decay else ():
        x, y = max(a, offset), min(b, offset + n)
        if x < y:
            master[x - offset : y - offset].mul_(1 - lr * weight_decay)
    adamw_update_(master, grad, exp_avg, exp_avg_sq, lr=lr, betas=betas, eps=eps, step=step)


@dataclass(frozen=True)
class Owned:
    """What an optimizer owns of one trainable parameter (the ``index``-th of its parameter
    group): the flat elements ``[start, stop)`` of the whole parameter (row-major), with 1-D
    views of their fp32 master values and AdamW moments. Checkpoints read and write these
    views in place (`runtime.sharded_checkpoint`)."""

    index: int
    start: int
    stop: int
    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments are sharded over the world (ZeRO-1).

    Rank r owns elements ``[r*S, (r+1)*S)`` of the flat parameters: it updates its fp32
    master copy of them (for fp32 parameters the master is the parameters' own storage),
    copies the result into the parameters and all-gathers, so that parameters stay
    replicated. Memory: `cost.base.state_recipe` (params + fp32 grads + 12/world bytes per
    parameter, one chunk of temporaries in the step). Decoupled weight decay applies to
    matrices (dim >= 2) only (``decay_ranges``); the update is torch.optim.AdamW's.
    Building it turns off the low-precision ``p.grad`` copies of ``flat``
    (`GradSync.materialize_grads`) and, with several ranks, makes its sync deliver each rank
    only its shard's sum (`GradSync.set_sharded`): read gradients with `Engine.full_gradients`
    (collective), or `Engine.gradients` on one rank.
    ``flat``: the flat parameter and gradient buffers it updates (an engine's ``grad_sync``).
    The hyperparameters live in ``param_groups[0]`` (one group; schedulers may change them
    between steps)."""

    def __init__(
        self,
        flat: GradSync,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if not lr >= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0:
            raise ValueError(f"bad AdamW settings lr={lr} betas={betas} eps={eps}")
        super().__init__(flat.params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.flat = flat
        lo = flat.rank * flat.shard_numel
        hi = lo + flat.shard_numel
        self._lo, self._hi = lo, hi
        self._param_shard = flat.flat_param[lo:hi]
        fp32 = flat.flat_param.dtype == torch.float32
        self.master = self._param_shard if fp32 else self._param_shard.float()
        self._grad_shard = flat.flat_grad[lo:hi]
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.decay_ranges = decay_ranges(flat.params, lo, hi)
        flat.materialize_grads = False  # the step reads the fp32 buffer: no low-precision p.grad copies
        flat.set_sharded(True)  # and only its shard of it: the sync reduces each bucket to its owner
        self.num_steps = 0

    @property
    def lr(self) -> float:
        """The learning rate of the next step (``param_groups[0]["lr"]``)."""
        return float(self.param_groups[0]["lr"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "param_groups", None):
            raise ValueError(
                "ZeroAdamW has one parameter group (the engine's flat parameters); build a second "
                "optimizer for parameters outside the engine"
            )
        # torch's method without its import of torch._dynamo where nothing compiles (`compat`)
        unless_compiling(torch.optim.Optimizer.add_param_group)(self, param_group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One AdamW update of this rank's shard with ``param_groups[0]``'s settings, then the
        parameters are all-gathered. ``closure`` is not supported (the step's gradients come
        from the engine's micro-batches and `sync_gradients`)."""
        if closure is not None:
            raise ValueError("ZeroAdamW.step takes no closure: run the micro-batches, dc.sync_gradients(), then step()")
        if not self.flat.synced:
            raise RuntimeError(
                "call dc.sync_gradients() before optimizer.step(): the gradients of this "
                "step have not been summed over the ranks yet"
            )
        group = self.param_groups[0]
        self.num_steps += 1
        adamw_step_(
            self.master,
            self._grad_shard,
            self.exp_avg,
            self.exp_avg_sq,
            self.decay_ranges,
            lr=float(group["lr"]),
            betas=tuple(group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=self.num_steps,
        )
        self.sync_params()

    def sync_params(self) -> None:
        """The master shard (just stepped or loaded) into the parameters' shard (a copy for
        low-precision parameters), then all-gathered into every rank's parameters. Collective."""
        if self.master is not self._param_shard:
            self._param_shard.copy_(self.master)
        comm.all_gather_shards_(self.flat.flat_param, self.flat.shard_numel)

    def owned(self) -> list[Owned]:
        """What this rank owns of each trainable parameter (`Owned`): the parts of its ZeRO-1
        range of the flat vector, parameter by parameter."""
        lo, hi = self._lo, min(self._hi, self.flat.numel)
        out, off = [], 0
        for i, p in enumerate(self.flat.params):
            x, y = max(off, lo), min(off + p.numel(), hi)
            if x < y:
                views = [t[x - lo : y - lo] for t in (self.master, self.exp_avg, self.exp_avg_sq)]
                out.append(Owned(i, x - off, y - off, *views))
            off += p.numel()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.flat.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state: elements ``[start, stop)`` of the
        unpadded flat parameter vector of ``numel`` elements (each rank saves its own)."""
        stop = min(self._hi, self.flat.numel)
        start = min(self._lo, stop)
        n = stop - start
        return {
            "num_steps": self.num_steps,
            "start": start,
            "stop": stop,
            "numel": self.flat.numel,
            "rank": self.flat.rank,
            "world_size": self.flat.world_size,
            "hparams": {k: (list(v) if k == "betas" else v) for k, v in self.param_groups[0].items() if k != "params"},
            **{k: getattr(self, k)[:n].detach().clone() for k in _STATE},
        }

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Loads this rank's shard from one saved shard (same world size and rank) or from a
        list of saved shards of any world size that together cover this rank's range
        (resharding: a world of 4 resumed as 2, or 2 as 4). Call on every rank together (the
        parameters are all-gathered afterwards). The saved hyperparameters (``hparams``: lr,
        ``initial_lr`` of a scheduler, ...) replace ``param_groups[0]``'s."""
        shards = [state] if isinstance(state, Mapping) else list(state)
        if not shards:
            raise ValueError("no optimizer shards to load")
        numels = {int(s["numel"]) for s in shards}
        if numels != {self.flat.numel}:
            raise ValueError(
                f"the optimizer state is for {sorted(numels)} parameters but this model has "
                f"{self.flat.numel}; load a checkpoint of the same model"
            )
        steps = {int(s["num_steps"]) for s in shards}
        if len(steps) != 1:
            raise ValueError(
                f"the optimizer shards are of different steps {sorted(steps)}; load the shards of one checkpoint"
            )
        lo, hi = min(self._lo, self.flat.numel), min(self._hi, self.flat.numel)
        covered = torch.zeros(hi - lo, dtype=torch.bool)
        new = {k: torch.zeros_like(getattr(self, k)) for k in _STATE}
        for s in shards:
            a, b = max(lo, int(s["start"])), min(hi, int(s["stop"]))
            if a >= b:
                continue
            src = slice(a - int(s["start"]), b - int(s["start"]))
            for k in _STATE:
                t = s[k]
                if t.numel() != int(s["stop"]) - int(s["start"]):
                    raise ValueError(
                        f"optimizer shard of rank {s['rank']}: {k} has {t.numel()} elements, "
                        f"its range [{s['start']}, {s['stop']}) needs {int(s['stop']) - int(s['start'])}"
                    )
                new[k][a - lo : b - lo].copy_(t[src])
            covered[a - lo : b - lo] = True
        if not bool(covered.all()):
            missing = int((~covered).sum())
            raise ValueError(
                f"the optimizer shards given cover only part of rank {self.flat.rank}'s range [{lo}, {hi}) "
                f"({missing} elements missing); pass every rank's shard of the checkpoint"
            )
        self.num_steps = steps.pop()
        hparams = dict(shards[0].get("hparams", {}))
        if "betas" in hparams:
            hparams["betas"] = tuple(hparams["betas"])
        self.param_groups[0].update(hparams)
        for k in _STATE:
            getattr(self, k).copy_(new[k])
        self.sync_params()

    def full_state(self) -> dict[str, Tensor]:
        """The unsharded state (every rank's shard gathered; on every rank): for tests and tools."""
        shards = comm.all_gather_object(self.state_dict())
        return {k: torch.cat([s[k] for s in shards]) for k in _STATE}
