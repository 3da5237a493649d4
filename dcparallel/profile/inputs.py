"""Synthetic micro-batches for profiling, built the way training builds them.

A ``make_inputs`` callable turns (bucket size, layout, the group's ranks, this rank) into
`Inputs`: this rank's `Batch` of ``layout.mbs`` samples of that size and the function that
runs the training loop's work on it (forward + summed loss). `adapter_inputs` derives it for
any adapted model from the adapter's synthetic samples, the loader's collate and the loop's
``loss_fn(model, batch, ctx)``; the other helpers are that for the reference models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn

from dcparallel.adapters import reference
from dcparallel.adapters.base import LossFn, ModelAdapter, derive_spec
from dcparallel.data.batch import Batch
from dcparallel.data.collate import resolve_collate
from dcparallel.models.dit import DiT
from dcparallel.models.llama import Llama
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import MicroBatchContext
from dcparallel.spec import Layout, ModelSpec, Size


class Inputs(NamedTuple):
    batch: Batch
    #: runs the forward inside ``dc.micro_batch(batch)`` and returns the shard's summed loss
    loss: Callable[[MicroBatchContext], Tensor]


class MakeInputs(Protocol):
    def __call__(self, size: Size, layout: Layout, ranks: tuple[int, ...], rank: int) -> Inputs: ...


def adapter_inputs(
    model: nn.Module, adapter: ModelAdapter, loss_fn: LossFn, device: torch.device, dtype: torch.dtype | None = None
) -> MakeInputs:
    """Profiling inputs of any adapted model: the adapter's synthetic items of the bucket's
    size, collated by the loader's own collate, moved to the model's device (floating inputs
    in its dtype), and the training loop's ``loss_fn(model, batch, ctx)``."""
    if adapter.sample is None:
        raise ValueError(
            f"{adapter.name}: no synthetic samples to profile with; pass sample_fn(size, index) "
            f"returning a dataset item of that size"
        )
    collate = resolve_collate(adapter.collate, adapter.kind)

    def make(size: Size, layout: Layout, ranks: tuple[int, ...], rank: int) -> Inputs:
        samples = {i: adapter.sample(size, i) for i in range(layout.mbs)}
        batch = collate(samples, MicroBatch(tuple(range(layout.mbs)), layout), ranks, rank).to(device, dtype)
        return Inputs(batch, lambda ctx: loss_fn(model, batch, ctx))

    return make


def text_inputs(model: Llama, device: torch.device) -> MakeInputs:
    """``mbs`` random documents of ``size`` tokens packed into one row, causal LM loss."""
    a = reference.adapter(model)
    return adapter_inputs(model, a, a.loss_fn, device)


def video_inputs(model: DiT, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> MakeInputs:
    """``mbs`` random latents of the bucket's shape, stacked; flow-matching loss."""
    a = reference.adapter(model)
    return adapter_inputs(model, a, a.loss_fn, device, dtype)


def model_spec(
    model: nn.Module,
    layers: Sequence[nn.Module],
    *,
    name: str,
    kind: str,
    hidden: int,
    num_heads: int,
    ffn_hidden: int,
    attention: str,
    layers_per_unit: int = 1,
    **extra,
) -> ModelSpec:
    """The planner's `ModelSpec` of a model whose blocks expose ``attn_block`` / ``mlp_block``
    (`adapters.derive_spec` for any other)."""
    if layers_per_unit < 1 or len(layers) % layers_per_unit:
        raise ValueError(
            f"{len(layers)} layers do not split into units of {layers_per_unit}; "
            f"pass a layers_per_unit that divides the number of layers"
        )
    return derive_spec(
        model,
        list(layers),
        name=name,
        kind=kind,
        hidden=hidden,
        num_heads=num_heads,
        ffn_hidden=ffn_hidden,
        attention=attention,
        blocks_per_layer=layers_per_unit,
        attn_modules=lambda b: [b.attn_block] if hasattr(b, "attn_block") else [],
        mlp_modules=lambda b: [b.mlp_block] if hasattr(b, "mlp_block") else [],
        **extra,
    )


def reference_spec(model: nn.Module, layers: Sequence[nn.Module], name: str | None = None) -> tuple[ModelSpec, int]:
    """(the planner's view, blocks per spec layer) of a reference model (Llama or DiT)."""
    if not reference.matches(model):
        raise ValueError(f"{type(model).__name__} is not a reference model: use dcparallel.adapters.find_adapter")
    a = reference.adapter(model, layers=layers, name=name)
    return a.spec, a.blocks_per_layer


def reference_inputs(model: nn.Module, spec: ModelSpec, device: torch.device) -> MakeInputs:
    """The profiling inputs of a reference model."""
    a = reference.adapter(model)
    return adapter_inputs(model, a, a.loss_fn, device, next(model.parameters()).dtype)
