"""Synthetic micro-batches for profiling, and the planner's view (`ModelSpec`) of a real model.

A ``make_inputs`` callable turns (bucket size, layout, the group's ranks, this rank) into
`Inputs`: this rank's `Batch` of ``layout.mbs`` samples of that size (text: documents packed
in one row; video: same-shape samples stacked) and the function that runs the forward and
returns the summed loss. `text_inputs` and `video_inputs` build them for the reference
models; any model works with a ``make_inputs`` of the same shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn

from dcparallel.data.batch import Batch
from dcparallel.models.dit import DiT, flow_matching_loss
from dcparallel.models.llama import Llama, per_token_loss
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import MicroBatchContext
from dcparallel.runtime.shard import text_batch, video_batch
from dcparallel.spec import Layout, ModelSpec, Size


class Inputs(NamedTuple):
    batch: Batch
    #: runs the forward inside ``dc.micro_batch(batch)`` and returns the shard's summed loss
    loss: Callable[[MicroBatchContext], Tensor]


class MakeInputs(Protocol):
    def __call__(self, size: Size, layout: Layout, ranks: tuple[int, ...], rank: int) -> Inputs: ...


def batch_to(batch: Batch, device: torch.device, dtype: torch.dtype | None = None) -> Batch:
    """The batch with its tensors on ``device``; floating inputs cast to ``dtype``."""
    changes = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, Tensor):
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            changes[f.name] = v.to(device)
    return dataclasses.replace(batch, **changes)


def text_inputs(model: Llama, device: torch.device, seed: int = 0) -> MakeInputs:
    """``mbs`` random documents of ``size`` tokens packed into one row, causal LM loss."""
    vocab = model.cfg.vocab_size

    def make(size: Size, layout: Layout, ranks: tuple[int, ...], rank: int) -> Inputs:
        if isinstance(size, tuple):
            raise ValueError(f"a text model takes token counts as bucket sizes; got the video size {size}")
        g = torch.Generator().manual_seed(seed)
        docs = {i: torch.randint(0, vocab, (int(size),), generator=g) for i in range(layout.mbs)}
        mb = MicroBatch(tuple(range(layout.mbs)), layout)
        batch = batch_to(text_batch(mb, ranks, rank, docs), device)

        def loss(ctx: MicroBatchContext) -> Tensor:
            ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
            return ctx.token_loss(ptl, batch.loss_mask)

        return Inputs(batch, loss)

    return make


def video_inputs(model: DiT, spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0
                 ) -> MakeInputs:
    """``mbs`` random latents of the bucket's shape (pixels -> latent grid by the spec's
    patchify rule), stacked; flow-matching loss at random timesteps."""
    patch_dim = model.cfg.patch_dim

    def make(size: Size, layout: Layout, ranks: tuple[int, ...], rank: int) -> Inputs:
        if not isinstance(size, tuple):
            raise ValueError(f"a video model takes (frames, height, width) bucket sizes; got {size!r}")
        frames, height, width = size
        t, _ = spec.latent_grid(size)
        nh, nw = math.ceil(height / spec.spatial_patch), math.ceil(width / spec.spatial_patch)
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(nh), torch.arange(nw), indexing="ij"), -1)
        pos = grid.reshape(-1, 3)
        g = torch.Generator().manual_seed(seed)
        toks = {i: torch.randn(pos.shape[0], patch_dim, generator=g) for i in range(layout.mbs)}
        mb = MicroBatch(tuple(range(layout.mbs)), layout)
        batch = batch_to(video_batch(mb, ranks, rank, toks, {i: pos for i in toks}, t), device, dtype)
        noise = torch.randn(batch.inputs.shape, generator=g).to(device=device, dtype=dtype)
        ts = torch.rand(layout.mbs, generator=g).to(device)

        def loss(ctx: MicroBatchContext) -> Tensor:
            ptl = flow_matching_loss(model, batch.inputs, batch.positions, ts, noise, batch.frames)
            return ctx.token_loss(ptl, batch.loss_mask)

        return Inputs(batch, loss)

    return make


def _count(modules: Sequence[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def model_spec(model: nn.Module, layers: Sequence[nn.Module], *, name: str, kind: str, hidden: int,
               num_heads: int, ffn_hidden: int, attention: str, layers_per_unit: int = 1,
               **extra) -> ModelSpec:
    """The planner's `ModelSpec` of a real model with its exact parameter counts: one spec
    layer is ``layers_per_unit`` consecutive blocks (a spatial + temporal pair: 2); per
    unit, the parameters of the blocks' ``attn_block`` / ``mlp_block`` and the rest; what is
    outside the layers is ``extra_params``."""
    if layers_per_unit < 1 or len(layers) % layers_per_unit:
        raise ValueError(f"{len(layers)} layers do not split into units of {layers_per_unit}; "
                         f"pass a layers_per_unit that divides the number of layers")
    unit = list(layers[:layers_per_unit])
    attn = _count([b.attn_block for b in unit if hasattr(b, "attn_block")])
    mlp = _count([b.mlp_block for b in unit if hasattr(b, "mlp_block")])
    other = _count(unit) - attn - mlp
    num_units = len(layers) // layers_per_unit
    total = sum(p.numel() for p in model.parameters())
    spec = ModelSpec(name=name, kind=kind, num_layers=num_units, hidden=hidden, num_heads=num_heads,
                     ffn_hidden=ffn_hidden, attention=attention, attn_params=attn, mlp_params=mlp,
                     other_params=other, extra_params=total - num_units * (attn + mlp + other),
                     attn_per_layer=layers_per_unit, **extra)
    assert spec.num_params == total
    return spec


def reference_spec(model: nn.Module, layers: Sequence[nn.Module], name: str | None = None
                   ) -> tuple[ModelSpec, int]:
    """(the planner's view, blocks per spec layer) of a reference model (Llama or DiT)."""
    if isinstance(model, Llama):
        c = model.cfg
        spec = model_spec(model, layers, name=name or f"llama-h{c.hidden}-l{c.num_layers}", kind="text",
                          hidden=c.hidden, num_heads=c.num_heads, ffn_hidden=c.ffn_hidden, attention="causal",
                          vocab_size=c.vocab_size, bytes_per_value=next(model.parameters()).element_size())
        return spec, 1
    if isinstance(model, DiT):
        c = model.cfg
        unit = 2 if c.attention == "factorized" else 1
        spec = model_spec(model, layers, name=name or f"dit-h{c.hidden}-l{c.num_layers}", kind="video", hidden=c.hidden,
                          num_heads=c.num_heads, ffn_hidden=c.mlp_ratio * c.hidden,
                          attention="factorized" if unit == 2 else "full", layers_per_unit=unit,
                          bytes_per_value=next(model.parameters()).element_size())
        return spec, unit
    raise ValueError(f"{type(model).__name__} is not a reference model: pass spec= (a ModelSpec) and "
                     f"make_inputs= (see dcparallel.profile.inputs) so it can be profiled")


def reference_inputs(model: nn.Module, spec: ModelSpec, device: torch.device) -> MakeInputs:
    """The profiling inputs of a reference model: packed random documents (Llama) or random
    latents of the bucket's shape (DiT)."""
    if isinstance(model, Llama):
        return text_inputs(model, device)
    if isinstance(model, DiT):
        return video_inputs(model, spec, device, next(model.parameters()).dtype)
    raise ValueError(f"{type(model).__name__} is not a reference model: pass make_inputs= "
                     f"(see dcparallel.profile.inputs) so it can be profiled")
