"""Models larger than one device: built without their weights, sharded, then given storage and
loaded shard by shard.

    with dcparallel.empty_init():                 # parameters on the meta device, no memory
        model = build_model()                     # buffers (rotary tables, ...) real, on CPU
    dc = dcparallel.DataCentricParallel(model, shard_size=8)   # FSDP2 per block, then this
    dc.load_weights("path/to/save_pretrained_dir")             # rank's shards, slice by slice

`empty_init` creates every parameter on the meta device but lets buffers be computed as the
model's constructor computes them (on CPU): non-persistent buffers such as rotary
``inv_freq`` are in no checkpoint, so they must be exact from the start. `materialize`
(called by `runtime.sharded.ShardedGrads` after ``fully_shard``) gives the sharded parameters
storage on the run's device (as ``to_empty``: only this rank's shards, in the dtype FSDP keeps)
and keeps the buffers the constructor computed (their own storage, never a copy). `load_weights`
reads every parameter's shard with ``safetensors.safe_open(...).get_slice`` straight into the
local storage: no rank ever holds a whole model, in any dtype; at most one parameter's slice is
in transit. The gradient shards get storage at the first micro-batch (`runtime.sharded`), so
wrapping and loading hold the parameter shards, the buffers and that one slice.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Builds a model without allocating its parameters: every parameter a module registers
    is put on the meta device; buffers stay where the constructor made them (so computed
    tables are exact). Wrap the model with shard_size > 1, then `load_weights`."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the meta device (built without storage)."""
    return any(p.device.type == "meta" for p in model.parameters())


def _non_persistent(model: nn.Module) -> set[str]:
    return {f"{mn}.{b}" if mn else b for mn, m in model.named_modules() for b in m._non_persistent_buffers_set}


def check_buffers(model: nn.Module) -> None:
    """Refuses a meta model whose non-persistent buffers are on the meta device too (built
    under ``torch.device("meta")``): no checkpoint holds them, so they could not be restored."""
    lost = sorted(n for n, b in model.named_buffers() if b.device.type == "meta" and n in _non_persistent(model))
    if lost:
        raise ValueError(
            f"the model's non-persistent buffers {lost} are on the meta device: no checkpoint holds "
            f"them, so their values are lost; build the model under dcparallel.empty_init() (parameters "
            f"on meta, buffers computed) instead of torch.device('meta')"
        )


def check_meta_model(model: nn.Module, shard_size: int) -> None:
    """A meta model can only be wrapped sharded (its shards get storage after ``fully_shard``)
    and with its non-persistent buffers computed (`check_buffers`): ValueError otherwise."""
    if shard_size <= 1:
        raise ValueError(
            f"the model is on the meta device but shard_size={shard_size}: a meta model is materialized "
            f"shard by shard, which needs shard_size > 1; pass shard_size=2 or more, or build the model "
            f"on its device and load its weights there (shard_size 1 holds the whole model per rank)"
        )
    check_buffers(model)


def materialize(model: nn.Module, device: torch.device) -> list[str]:
    """Storage on ``device`` for every parameter and buffer of a (sharded) meta model: the
    parameters are left uninitialized (`load_weights` fills them), the buffers that hold
    values keep them (and their storage, on ``device``). Returns the names of persistent buffers that were on meta
    (the checkpoint must supply them)."""
    check_buffers(model)
    missing = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    tied = [names for names in _names_by_tensor(model.named_parameters(remove_duplicate=False)) if len(names) > 1]
    # `Module.to_empty`'s walk (`_apply`, which FSDP2 extends to re-register its shards), except
    # that a tensor with values (a computed buffer) keeps its storage (moved only across devices):
    # no copy of it is held, no empty twice allocated
    model._apply(lambda t: torch.empty_like(t, device=device) if t.device.type == "meta" else t.to(device))
    for first, *aliases in tied:  # the walk makes a new parameter per module: tie them again
        for alias in aliases:
            owner, _, attr = alias.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = model.get_parameter(first)
    return missing


def _files(folder: Path) -> dict[str, Path]:
    """Checkpoint key -> safetensors file of a ``save_pretrained`` folder (one file, or the
    shards an ``*.safetensors.index.json`` names)."""
    from safetensors import safe_open

    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} holds no *.safetensors file; save the model there with save_pretrained (or "
            f"safetensors.torch.save_file of its state_dict)"
        )
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update(dict.fromkeys(h.keys(), f))
    return out


def _local_box(t: Tensor) -> tuple[Tensor, tuple[slice, ...]]:
    """This rank's local storage of ``t`` and the box of the whole tensor it holds (a DTensor
    sharded as FSDP2 shards: torch.chunk per sharded dim; a plain tensor: all of it)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    box = [slice(0, n) for n in t.shape]
    for axis, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            d, n = placement.dim, t.device_mesh.size(axis)
            size = box[d].stop - box[d].start
            chunk = -(-size // n)
            lo = min(box[d].start + t.device_mesh.get_local_rank(axis) * chunk, box[d].stop)
            box[d] = slice(lo, min(lo + chunk, box[d].stop))
    local = t.to_local()
    assert tuple(local.shape) == tuple(s.stop - s.start for s in box), (t.shape, t.placements, local.shape, box)
    return local, tuple(box)


def _keys(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter and persistent buffer by its first name, with all its names (tied
    weights have several; a checkpoint may hold any one of them)."""
    skip = _non_persistent(model)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {ns[0]: ns for ns in _names_by_tensor(named) if ns[0] not in skip}


def _names_by_tensor(named) -> list[list[str]]:
    """The names of each distinct tensor of ``(name, tensor)`` pairs, in order of appearance."""
    names: dict[int, list[str]] = {}
    for n, t in named:
        names.setdefault(id(t), []).append(n)
    return list(names.values())


def load_weights(model: nn.Module, folder: str | Path) -> None:
    """Loads the weights of a ``save_pretrained`` folder (safetensors) into ``model``, each
    rank reading only its shard of every parameter (whole tensors for unsharded ones),
    cast to the parameter's dtype. Every parameter and persistent buffer must be in the
    checkpoint and every checkpoint key must name one: ValueError naming them otherwise."""
    import importlib.util

    if importlib.util.find_spec("safetensors") is None:
        raise ValueError(
            "load_weights reads safetensors files and needs the safetensors package: pip install "
            "safetensors (or 'dcparallel[train]')"
        )
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"load_weights: {str(folder)!r} is not a directory; give a save_pretrained folder")
    files = _files(folder)
    tensors = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    plan, missing = {}, []
    for first, names in _keys(model).items():
        found = next((n for n in names if n in files), None)
        (missing.append(first) if found is None else plan.setdefault(files[found], []).append((found, first)))
    known = {n for ns in _keys(model).values() for n in ns} | _non_persistent(model)
    unexpected = sorted(set(files) - known)
    if missing or unexpected:
        raise ValueError(
            f"load_weights({str(folder)!r}): the checkpoint does not fit the model: missing "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; save the folder from a model of the same class "
            f"and config"
        )
    with torch.no_grad():
        for f, items in plan.items():
            with safe_open(str(f), framework="pt") as h:
                for key, name in items:
                    _load_one(h, key, tensors[name])


def _load_one(h, key: str, t: Tensor) -> None:
    local, box = _local_box(t)
    sl = h.get_slice(key)
    if tuple(sl.get_shape()) != tuple(t.shape):
        raise ValueError(
            f"load_weights: {key} is {tuple(sl.get_shape())} in the checkpoint but "
            f"{tuple(t.shape)} in the model; save the folder from a model of the same config"
        )
    if local.numel():
        local.copy_(sl[box] if box else h.get_tensor(key))
