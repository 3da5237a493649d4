"""`GroupedZeroAdamW`: `runtime.zero.ZeroAdamW` with torch's parameter groups, what
``dc.optimizer(params_or_groups, ...)`` builds when it is given parameters or groups.

Each group is a torch-style dict (``{"params": [...], "lr": ..., "weight_decay": ...}``; keys
not given take the optimizer's defaults). The update is torch.optim.AdamW's per group: every
tensor of a group is decayed by its group's ``weight_decay`` (torch's rule; the engine's
default optimizer decays matrices only), and a trainable parameter in no group is not
updated, as torch leaves a parameter it was not given. On this rank's ZeRO-1 shard a group is
a list of ``(start, stop)`` ranges (`group_ranges`), each updated with its group's settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dcparallel.runtime.zero import ZeroAdamW, adamw_step_

if TYPE_CHECKING:
    from dcparallel.runtime.grad_sync import GradSync

_HPARAMS = ("lr", "betas", "eps", "weight_decay")


def as_groups(params_or_groups: Iterable[Any], defaults: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Torch's forms (an iterable of tensors, or of dicts with ``params``) as a list of groups,
    each with every hyperparameter (missing ones from ``defaults``); unknown keys refused."""
    items = list(params_or_groups)
    if not items:
        raise ValueError(
            "dc.optimizer() got an empty parameter list; pass model.parameters(), groups, or nothing "
            "(every trainable parameter)"
        )
    if not isinstance(items[0], Mapping):
        items = [{"params": items}]
    groups = []
    for i, g in enumerate(items):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ValueError(f"parameter group {i} is {type(g).__name__}: give tensors, or dicts with 'params'")
        odd = sorted(set(g) - {"params", *_HPARAMS})
        if odd:
            raise ValueError(
                f"parameter group {i} has keys {odd} dc.optimizer() does not apply; AdamW's are {list(_HPARAMS)}"
            )
        params = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
        groups.append({**defaults, **{k: g[k] for k in _HPARAMS if k in g}, "params": params})
    return groups


def group_ranges(
    flat_params: Sequence[Tensor], groups: Sequence[Mapping[str, Any]], lo: int, hi: int
) -> list[list[tuple[int, int]]]:
    """For each group, its parameters' parts of the flat range ``[lo, hi)`` as ``(start, stop)``
    offsets from ``lo``. Refuses a tensor that is not a trainable parameter of the engine, or
    one named in two groups."""
    where: dict[int, int] = {}
    for i, g in enumerate(groups):
        for p in g["params"]:
            if id(p) in where:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is in groups {where[id(p)]} and {i}; "
                    f"name each parameter in one group (torch refuses this too)"
                )
            where[id(p)] = i
    known = {id(p) for p in flat_params}
    for i, g in enumerate(groups):
        stray = [tuple(p.shape) for p in g["params"] if id(p) not in known]
        if stray:
            raise ValueError(
                f"parameter group {i} holds tensors of shapes {stray[:3]} that are not trainable "
                f"parameters of the wrapped model; give the model's own parameters (after wrapping)"
            )
    out: list[list[tuple[int, int]]] = [[] for _ in groups]
    off = 0
    for p in flat_params:
        a, b = max(off, lo), min(off + p.numel(), hi)
        i = where.get(id(p))
        if i is not None and a < b:
            ranges = out[i]
            if ranges and ranges[-1][1] == a - lo:
                ranges[-1] = (ranges[-1][0], b - lo)
            else:
                ranges.append((a - lo, b - lo))
        off += p.numel()
    return out


class GroupedZeroAdamW(ZeroAdamW):
    """`ZeroAdamW` whose ``param_groups`` are the user's groups (schedulers drive each
    group's ``lr``); ``groups`` as `as_groups` returns them."""

    def __init__(self, flat: GradSync, groups: list[dict[str, Any]]):
        first = groups[0]
        super().__init__(flat, **{k: first[k] for k in _HPARAMS})
        self.ranges = group_ranges(flat.params, groups, self._lo, self._hi)
        for g in groups:
            if not g["lr"] >= 0 or not 0 <= g["betas"][0] < 1 or not 0 <= g["betas"][1] < 1 or not g["eps"] > 0:
                raise ValueError(f"bad AdamW settings in a parameter group: { ({k: g[k] for k in _HPARAMS}) }")
            g["betas"] = tuple(g["betas"])
        self.param_groups = groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "param_groups", None):
            raise ValueError(
                "give every parameter group to dc.optimizer() at once: the ZeRO-1 shards are laid out when it is built"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One AdamW update of this rank's shard, each group's ranges with its settings, then
        the parameters are all-gathered."""
        if closure is not None:
            raise ValueError(
                "the optimizer's step takes no closure: run the micro-batches, dc.sync_gradients(), then step()"
            )
        if not self.flat.synced:
            raise RuntimeError(
                "call dc.sync_gradients() before optimizer.step(): the gradients of this step have "
                "not been summed over the ranks yet"
            )
        self.num_steps += 1
        for g, ranges in zip(self.param_groups, self.ranges, strict=True):
            lr = float(g["lr"])
            for a, b in ranges:  # the group's decay covers its whole range
                adamw_step_(
                    self.master[a:b],
                    self._grad_shard[a:b],
                    self.exp_avg[a:b],
                    self.exp_avg_sq[a:b],
                    [(a, b)],
                    offset=a,
                    lr=lr,
                    betas=g["betas"],
                    eps=g["eps"],
                    weight_decay=g["weight_decay"],
                    step=self.num_steps,
                )
        self.sync_params()

    def state_dict(self) -> dict[str, Any]:
        """`ZeroAdamW.state_dict` plus every group's hyperparameters (``group_hparams``)."""
        state = super().state_dict()
        state["group_hparams"] = [
            {k: (list(v) if k == "betas" else v) for k, v in g.items() if k != "params"} for g in self.param_groups
        ]
        return state

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """`ZeroAdamW.load_state_dict`; the saved groups' hyperparameters replace each group's."""
        super().load_state_dict(state)
        first = state if isinstance(state, Mapping) else state[0]
        saved = first.get("group_hparams", [])
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"the optimizer state has {len(saved)} parameter groups, this optimizer "
                f"{len(self.param_groups)}; build it with the groups of the run that saved it"
            )
        for g, h in zip(self.param_groups, saved, strict=True):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in h.items()})
