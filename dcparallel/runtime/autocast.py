"""A training loop whose forward runs under `torch.autocast` (the HF Trainer's ``bf16=True``):
which dtypes dcparallel accepts, the weights autocast copies, and the loss function as the
profiler must run it to measure what training runs.

Under ``torch.autocast(dtype=bfloat16)`` every fp32 weight a matmul or convolution uses is
cast to a 16-bit copy. The copy of a trainable weight is kept in autocast's cast cache until
the autocast region exits (the end of the forward) and by autograd, which saves it for the
input gradient, until that layer's backward: 2 bytes per cast parameter, held through the
micro-batch at its forward's end, where the activations peak too. `cast_params` counts them
for the model states (`cost.base.state_recipe`); a model stored in 16 bits casts nothing.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dcparallel.adapters.base import LossFn, ModelAdapter

#: the autocast dtypes a micro-batch may run under (2 bytes a value; fp16 needs the caller's loss scaling)
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)

#: modules whose forward autocast runs in 16 bits with their every parameter (weight and bias)
_CAST_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def check_autocast(dtype: torch.dtype | None) -> None:
    """ValueError naming ``dtype`` unless None or one of `AUTOCAST_DTYPES`."""
    if dtype is not None and dtype not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast={dtype!r}: give the dtype the forward runs under torch.autocast in "
            f"(torch.bfloat16 or torch.float16), or None when it runs without autocast"
        )


def cast_params(model: nn.Module) -> int:
    """Elements of the fp32 parameters a forward under autocast copies to 16 bits, each tensor
    once (tied weights are one tensor): the parameters of linear and convolution modules, and
    every other fp32 parameter of two or more dimensions that is not only an embedding table
    (expert weights multiplied by `torch.bmm` and the like; an embedding lookup is not cast)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            linear = isinstance(module, _CAST_MODULES) or type(module).__name__ == "Conv1D"  # GPT-2's linear
            if p.dtype == torch.float32 and (linear or (p.dim() >= 2 and not isinstance(module, nn.Embedding))):
                seen[id(p)] = p.numel()  # a tied output head reaches its embedding table here
    return sum(seen.values())


def with_autocast(adapter: ModelAdapter, model: nn.Module, dtype: torch.dtype | None) -> ModelAdapter:
    """``adapter`` with its spec counting the weights a forward under autocast to ``dtype``
    copies (`ModelSpec.autocast_params`); ``adapter`` itself when ``dtype`` is None. A
    ValueError names a ``dtype`` autocast does not cast to (`check_autocast`)."""
    check_autocast(dtype)
    if dtype is None:
        return adapter
    return dataclasses.replace(adapter, spec=dataclasses.replace(adapter.spec, autocast_params=cast_params(model)))


def under_autocast(loss_fn: LossFn, device: torch.device, dtype: torch.dtype | None) -> LossFn:
    """``loss_fn`` with its forward under ``torch.autocast(device.type, dtype)`` (the backward
    outside it, as the Trainer runs it); ``loss_fn`` itself when ``dtype`` is None."""
    if dtype is None:
        return loss_fn

    def autocast_loss(model, batch, ctx):
        with torch.autocast(device.type, dtype=dtype):
            return loss_fn(model, batch, ctx)

    return autocast_loss
