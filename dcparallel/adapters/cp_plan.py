"""diffusers' context-parallel plans (a model's ``_cp_plan``) applied by dcparallel's own hooks.

A diffusers model that can run context-parallel declares where its token sequence is cut
and joined: per module, inputs split (by parameter name) before its forward, outputs split
(by index) after it, outputs gathered after it, each along a dim and only for tensors of
the plan's ``expected_dims``. dcparallel reads that plan and applies it with plain PyTorch
module hooks that ask the runtime's attention (`UlyssesAttention.state()`) for the active
micro-batch's SP group and shard geometry at every call. diffusers' own hooks
(`hooks/context_parallel.py`) serve inference on one static mesh: the group is fixed when
they are installed, a split needs the length divisible by the group (no padding), and
their gather's backward keeps a rank's slice of the gradient instead of summing the
group's. dcparallel's group changes from micro-batch to micro-batch, token counts are odd,
and the loss is counted 1/sp per rank on the gathered output (`MicroBatchContext.dense_loss`),
so its hooks differ in exactly those three points:

* the group is read per call (SP 1 or outside a micro-batch: nothing is cut);
* a split pads only this rank's shard to ``Batch.shard_len`` (never a full-length padded
  copy): tokens of the padded length ``Batch.padded_len`` past the real ``seq_len`` are
  zeros, which attention ignores (`cu_seqlens`);
* a gather all-gathers the shards, drops the padding and sums the group's gradients in
  backward (`runtime.comm.gather_seq`).

Text stays whole on every rank: plan entries named in ``replicated`` (the text embeddings,
its mask and ids) are not split, so cross-attention to text needs no exchange and joint
text + video attention exchanges only the video tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dcparallel.data.ring_order import shard_columns
from dcparallel.runtime import comm

#: inputs that carry text (or its mask / position ids): kept whole on every rank of a group
TEXT_INPUTS = frozenset({"encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_mask", "txt_ids"})


@dataclass(frozen=True)
class Cut:
    """One entry of a plan: split (``gather`` False) or gather ``target`` of ``module``
    along ``dim``; ``target`` a forward parameter's name (an input) or an output's index;
    only tensors of ``expected_dims`` dimensions (None: any)."""

    module: str
    target: str | int
    dim: int
    expected_dims: int | None
    gather: bool = False


def read_plan(
    model: nn.Module,
    replicated: Collection[str] = TEXT_INPUTS,
    replicated_outputs: Collection[tuple[str, int]] = (),
    plan: dict | None = None,
) -> list[Cut]:
    """The model's ``_cp_plan`` as `Cut` entries, without the inputs kept whole
    (``replicated`` names, ``replicated_outputs`` (module, index) pairs). ``plan``: a plan in
    diffusers' format for a model that declares none (a look-alike of a planned family)."""
    plan = plan if plan is not None else getattr(model, "_cp_plan", None)
    who = type(model).__name__
    if not plan:
        raise ValueError(
            f"{who} has no context-parallel plan (_cp_plan): dcparallel shards a diffusers model's "
            f"tokens where that plan says; train it on one rank per sample (SP 1) with your own "
            f"adapter, or pass adapter=dcparallel.adapters.ModelAdapter(...) with install_hooks"
        )
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    cuts = []
    for module, entry in plan.items():
        if isinstance(entry, dict):
            for target, spec in entry.items():
                specs = spec if isinstance(spec, (list, tuple)) else [spec]
                if len(specs) != 1 or not isinstance(specs[0], ContextParallelInput):
                    raise ValueError(
                        f"{who}._cp_plan[{module!r}][{target!r}] = {spec!r}: dcparallel applies one "
                        f"ContextParallelInput per input or output; pass your own adapter"
                    )
                s = specs[0]
                if isinstance(target, int) != s.split_output:
                    raise ValueError(
                        f"{who}._cp_plan[{module!r}][{target!r}]: output indices need split_output=True "
                        f"and input names split_output=False"
                    )
                if target in replicated or (module, target) in replicated_outputs:
                    continue
                cuts.append(Cut(module, target, s.split_dim, s.expected_dims))
        else:
            specs = entry if isinstance(entry, (list, tuple)) else [entry]
            if not all(isinstance(s, ContextParallelOutput) for s in specs):
                raise ValueError(f"{who}._cp_plan[{module!r}] = {entry!r}: expected ContextParallelOutput entries")
            cuts += [Cut(module, i, s.gather_dim, s.expected_dims, gather=True) for i, s in enumerate(specs)]
    return cuts


def submodules(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules a plan key names: "" the model, dotted paths, one ``*`` over a ModuleList."""
    found = [model]
    for atom in name.split(".") if name else []:
        nxt = []
        for m in found:
            if atom == "*":
                if not isinstance(m, nn.ModuleList):
                    raise ValueError(f"plan key {name!r}: '*' must stand for the items of a ModuleList")
                nxt += list(m)
            elif hasattr(m, atom):
                nxt.append(getattr(m, atom))
            else:
                raise ValueError(f"plan key {name!r}: {type(m).__name__} has no sub-module {atom!r}")
        found = nxt
    return found


def shard(x: Tensor, dim: int, batch: Any) -> Tensor:
    """This rank's ``shard_len`` positions along ``dim`` of a whole ``seq_len`` sequence, a
    copy of its own (a view would keep the whole tensor alive wherever a block saves it for
    backward), padded with zeros only where it runs past the real tokens."""
    if batch.ring > 1:  # the zigzag columns of ring attention (`data.ring_order`)
        cols = torch.tensor(batch.shard_columns(), device=x.device)
        part = x.index_select(dim, cols[cols < batch.seq_len])
        pad = len(cols) - part.shape[dim]
        return part if pad == 0 else torch.cat([part, part.new_zeros(_resized(part.shape, dim, pad))], dim=dim)
    lo, n = batch.shard_start, batch.shard_len
    real = max(0, min(n, batch.seq_len - lo))
    part = x.narrow(dim, min(lo, x.shape[dim]), real)
    if real == n:
        return part.clone()
    shape = list(x.shape)
    shape[dim] = n - real
    return torch.cat([part, x.new_zeros(shape)], dim=dim)


def gather(x: Tensor, dim: int, group: Any, batch: Any) -> Tensor:
    """The group's shards along ``dim`` joined, padding dropped (gradients summed in backward);
    under ring attention put back from the zigzag order into the sequence's."""
    whole = comm.gather_seq(x, group, dim=dim)
    if batch.ring > 1:
        order = [c for slot in range(batch.sp) for c in shard_columns(batch.padded_len, batch.sp, batch.ring, slot)]
        where = torch.empty(len(order), dtype=torch.long)
        where[torch.tensor(order)] = torch.arange(len(order))
        return whole.index_select(dim, where[: batch.seq_len].to(x.device))
    return whole.narrow(dim, 0, batch.seq_len)


def _resized(shape: torch.Size, dim: int, n: int) -> list[int]:
    out = list(shape)
    out[dim] = n
    return out


class PlanHooks:
    """The hooks of one model's plan: `install` puts them on the modules and returns the
    handles. Each hook does nothing unless a micro-batch with SP > 1 is active on
    ``attention`` and the batch is whole on every rank (``Batch.sharded`` False)."""

    def __init__(self, model: nn.Module, cuts: list[Cut], attention: Any):
        self.model, self.cuts, self.attention = model, cuts, attention
        self.who = type(model).__name__

    def active(self) -> tuple[Any, Any] | None:
        a = self.attention.state()
        if a is None or a.batch is None or a.batch.sharded or a.sp == 1:
            return None
        return (a.group if a.ring is None else a.ring.group), a.batch  # the whole SP group

    def _cut(self, cut: Cut, x: Any, batch: Any) -> Any:
        if not isinstance(x, Tensor) or (cut.expected_dims is not None and x.dim() != cut.expected_dims):
            return x  # the plan's rule: only tensors of the expected rank are split (e.g. per-token timesteps)
        if x.shape[cut.dim] != batch.seq_len:
            raise ValueError(
                f"{self.who}'s context-parallel plan splits {cut.module or 'the model'}'s "
                f"{cut.target!r} along dim {cut.dim}, but that tensor {tuple(x.shape)} has "
                f"{x.shape[cut.dim]} positions there, not the micro-batch's {batch.seq_len} tokens; "
                f"give per-token inputs one entry per token (or the collate a matching token count)"
            )
        return shard(x, cut.dim, batch)

    def install(self) -> list[Any]:
        handles = []
        by_module: dict[str, list[Cut]] = {}
        for c in self.cuts:
            by_module.setdefault(c.module, []).append(c)
        for name, cuts in by_module.items():
            for m in submodules(self.model, name):
                ins = [c for c in cuts if isinstance(c.target, str)]
                outs = [c for c in cuts if isinstance(c.target, int)]
                if ins:
                    handles.append(m.register_forward_pre_hook(self._input_hook(m, ins), with_kwargs=True))
                if outs:
                    handles.append(m.register_forward_hook(self._output_hook(outs)))
        return handles

    def _input_hook(self, module: nn.Module, cuts: list[Cut]):
        params = list(inspect.signature(type(module).forward).parameters)[1:]
        for c in cuts:
            if c.target not in params:
                raise ValueError(
                    f"{self.who}'s context-parallel plan splits the input {c.target!r} of "
                    f"{c.module or 'the model'} ({type(module).__name__}), whose forward takes "
                    f"{params}; this diffusers version's plan and model disagree"
                )

        def hook(mod: nn.Module, args: tuple, kwargs: dict):
            active = self.active()
            if active is None:
                return None
            _, batch = active
            args = list(args)
            for c in cuts:
                if c.target in kwargs:
                    kwargs[c.target] = self._cut(c, kwargs[c.target], batch)
                else:
                    i = params.index(c.target)
                    if i < len(args):
                        args[i] = self._cut(c, args[i], batch)
            return tuple(args), kwargs

        return hook

    def _output_hook(self, cuts: list[Cut]):
        def hook(mod: nn.Module, args: tuple, output: Any):
            active = self.active()
            if active is None:
                return None
            group, batch = active
            single = isinstance(output, Tensor)
            out = [output] if single else list(output)
            for c in cuts:
                if c.gather:
                    x = out[c.target]
                    if c.expected_dims is None or x.dim() == c.expected_dims:
                        out[c.target] = gather(x, c.dim, group, batch)
                else:
                    out[c.target] = self._cut(c, out[c.target], batch)
            return out[0] if single else type(output)(out)

        return hook
