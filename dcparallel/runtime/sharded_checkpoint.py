"""The tensors of a run in `torch.distributed.checkpoint`'s format, keyed by parameter name,
for any shard size: a checkpoint saved at one world size and shard size loads at any other.

    model/<name>                  the parameter's fp32 master values, in its own shape
    optim/<name>/exp_avg          Adam's moments, in the parameter's shape
    optim/<name>/exp_avg_sq
    optim/num_steps               a plain int64 tensor (the same on every rank)
    buffer/<name>                 a persistent buffer (one the model's state dict holds), whole,
                                  in its own dtype (a 0-d one with one dimension of 1)

Every rank writes (and reads) only what its optimizer owns: one contiguous flat range of
each parameter (row-major). With shard_size 1 that is the ZeRO-1 range of the flat vector
(`runtime.zero.ZeroAdamW`: the fp32 master and the moments); with shard_size s > 1 it is this
replica's piece of the rank's FSDP shard (`runtime.sharded_optim.ShardedAdamW`: the fp32
sharded parameter and the moments). The owned ranges of all ranks partition every parameter,
so nothing is written twice and nothing is all-gathered. A flat range is cut into the few
boxes (offsets, sizes) it covers (`flat_boxes`) and handed to DCP as a ShardedTensor whose
local shards are views of the rank's own buffers, so DCP reads and writes in place and
reshards on load by overlapping boxes. What a rank owns comes from its optimizer's `owned`
(`runtime.zero.Owned`). One process without a process group (a world of one) owns every
element and hands DCP its whole tensors, viewed in place.

Persistent buffers (BatchNorm's running statistics, a step counter, an EMA kept as a buffer)
are replicated: every rank hands DCP its own copy, the model's tensor itself, which DCP writes
once and loads into every rank's copy in place. A save first checks that the ranks' copies
are identical and refuses, naming the buffer, when they are not (a buffer updated from each
rank's own samples): one copy could not resume the others exactly (`runtime.buffers`, which
also refuses running statistics when the model is wrapped and compares the copies in `prepare`). A load refuses a
checkpoint whose buffers are not the model's, by name. Frozen parameters are not saved: no
step changes them, so the model as built (its pretrained weights) holds their values.

The metadata file of a checkpoint is read with a restricted unpickler (`SafeReader`): only
DCP's metadata classes and torch's dtypes, so a checkpoint cannot run code when read; the
data files hold raw tensor bytes only.

Only tensors: the loader position, RNG state and commit protocol are `dcparallel.checkpoint`'s.
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dcparallel.runtime import comm
from dcparallel.runtime.buffers import check_buffers_agree, persistent_buffers  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from dcparallel.runtime.engine import Engine

_MOMENTS = ("exp_avg", "exp_avg_sq")
STEPS_KEY = "optim/num_steps"
BUFFER_PREFIX = "buffer/"


def model_key(name: str) -> str:
    """The key of parameter ``name``'s (fp32 master) values."""
    return f"model/{name}"


def optim_key(name: str, moment: str) -> str:
    """The key of parameter ``name``'s AdamW ``moment`` (``exp_avg``, ``exp_avg_sq``)."""
    return f"optim/{name}/{moment}"


def buffer_key(name: str) -> str:
    """The key of persistent buffer ``name``'s values."""
    return f"{BUFFER_PREFIX}{name}"


def _buffer_state(engine: Engine, saving: bool) -> dict[str, Tensor]:
    """The DCP entries of the model's persistent buffers: its own tensors (a 0-d one viewed
    with one dimension of 1), loaded in place. ``saving``: refused unless every rank holds
    the same values (`runtime.buffers.check_buffers_agree`)."""
    if saving:
        check_buffers_agree(engine.model, "checkpoint save")
    buffers = persistent_buffers(engine.model)
    return {buffer_key(n): b.view(1) if b.dim() == 0 else b for n, b in buffers.items()}


def _check_buffers(path: str | Path, state: dict[str, Any]) -> None:
    """Refuses a checkpoint whose saved persistent buffers are not this model's, by name."""
    saved = {k for k in read_keys(path) if k.startswith(BUFFER_PREFIX)}
    wanted = {k for k in state if k.startswith(BUFFER_PREFIX)}
    if saved != wanted:
        cut = len(BUFFER_PREFIX)
        raise ValueError(
            f"{path} holds the persistent buffers {sorted(k[cut:] for k in saved)[:5]}, this model has "
            f"{sorted(k[cut:] for k in wanted)[:5]} (missing: {sorted(k[cut:] for k in wanted - saved)[:5]}, "
            f"unknown: {sorted(k[cut:] for k in saved - wanted)[:5]}); resume with the model the run "
            f"was trained with"
        )


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offsets, sizes) that the flat range [start, stop) of a row-major tensor of
    ``shape`` covers, in order; each box is contiguous in memory (a range of one dimension
    with every later dimension whole), so the range's elements are the boxes' one after the
    other."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def row(r: int, a: int, b: int) -> None:
        out.extend(((r, *o), (1, *s)) for o, s in flat_boxes(shape[1:], a, b))

    if r0 == r1:
        row(r0, c0, c1)
        return out
    if c0:
        row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        row(r1, 0, c1)
    return out


@dataclass(frozen=True)
class Segment:
    """The part of parameter ``name`` a rank owns: flat elements [start, stop) of the whole
    parameter (row-major), with its 1-D views of them (``model``: fp32 master values,
    ``exp_avg``, ``exp_avg_sq``)."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    views: dict[str, Tensor]


def segments(engine: Engine, opt: Any) -> list[Segment]:
    """What this rank's optimizer owns of every trainable parameter (module docstring), by
    parameter name (the optimizer's `owned`)."""
    from dcparallel.runtime.sharded_optim import ShardedAdamW
    from dcparallel.runtime.zero import ZeroAdamW

    if isinstance(opt, ShardedAdamW) and opt.grads is engine.grad_sync:
        names, params = opt.grads.names, opt.grads.params
    elif isinstance(opt, ZeroAdamW) and opt.flat is engine.grad_sync:
        names = [n for n, p in engine.model.named_parameters() if p.requires_grad]
        params = opt.flat.params
    else:
        raise ValueError(
            f"a checkpoint saves the engine's own optimizer (engine.optimizer()), not a {type(opt).__name__}"
        )
    out = []
    for o in opt.owned():
        views = {"model": o.master, "exp_avg": o.exp_avg, "exp_avg_sq": o.exp_avg_sq}
        out.append(Segment(names[o.index], tuple(params[o.index].shape), o.start, o.stop, views))
    return out


def _whole_state(mine: list[Segment], opt: Any) -> dict[str, Any]:
    """The DCP state dict of one process: views of its buffers in each parameter's shape."""
    state: dict[str, Any] = {STEPS_KEY: torch.tensor([opt.num_steps], dtype=torch.int64)}
    for s in mine:
        shape = s.shape or (1,)  # a 0-d parameter is stored with one dimension of 1
        state[model_key(s.name)] = s.views["model"].view(shape)
        state.update({optim_key(s.name, k): s.views[k].view(shape) for k in _MOMENTS})
    return state


def _state(engine: Engine, opt: Any) -> dict[str, Any]:
    """The DCP state dict: one ShardedTensor per key over every rank's owned boxes (in one
    process without a process group: the whole tensors)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    mine = segments(engine, opt)
    if not comm.is_distributed():  # one process owns every element: its own tensors, whole
        return _whole_state(mine, opt)
    device = str(mine[0].views["model"].device) if mine else str(engine.params[0].device)
    everyone = comm.all_gather_object((device, {s.name: (s.start, s.stop) for s in mine}))
    shapes = {n: tuple(p.shape) for n, p in engine.model.named_parameters() if p.requires_grad}
    rank = comm.world_rank()
    by_name = {s.name: s for s in mine}
    state: dict[str, Any] = {}
    for name, shape in shapes.items():
        ckpt_shape = shape or (1,)  # a 0-d parameter is stored with one dimension of 1
        metas, local = [], {"model": [], **{k: [] for k in _MOMENTS}}
        for r, (dev, ranges) in enumerate(everyone):
            if name not in ranges:
                continue
            a = 0  # where the box starts in the owner's segment
            for off, size in flat_boxes(ckpt_shape, *ranges[name]):
                md = ShardMetadata(shard_offsets=list(off), shard_sizes=list(size), placement=f"rank:{r}/{dev}")
                metas.append(md)
                n = math.prod(size)
                if r == rank:
                    for k in local:
                        local[k].append(Shard(tensor=by_name[name].views[k][a : a + n].view(size), metadata=md))
                a += n
        for k, shards in local.items():
            props = TensorProperties(dtype=torch.float32)
            meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(ckpt_shape), tensor_properties=props)
            key = model_key(name) if k == "model" else optim_key(name, k)
            state[key] = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)
    state[STEPS_KEY] = torch.tensor([opt.num_steps], dtype=torch.int64)
    return state


def save(path: str | Path, engine: Engine, opt: Any) -> None:
    """Writes the parameters and the optimizer state into the folder ``path`` (collective:
    every rank calls it; DCP writes one data file per rank, then rank 0 its ``.metadata``).
    A checkpoint already in ``path`` (the HF Trainer saving a step again after a resume) is
    removed first (`_clear`): DCP writing over it would leave the old world's extra data
    files beside the new ones, and an interrupted save the old ``.metadata`` over new data;
    the writer refuses (``overwrite=False``) any checkpoint still there."""
    import torch.distributed.checkpoint as dcp

    _clear(Path(path))
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, overwrite=False)
    with warnings.catch_warnings():  # DCP warns when it saves in one process: a world of one does
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        state = {**_state(engine, opt), **_buffer_state(engine, saving=True)}
        dcp.save(state, storage_writer=writer, no_dist=not comm.is_distributed())


def _clear(path: Path) -> None:
    """Rank 0 removes the DCP checkpoint in ``path`` (its ``.metadata`` and ``*.distcp`` data
    files; nothing else in the folder), then every rank waits for it (collective)."""
    if comm.world_rank() == 0 and path.is_dir():
        for f in [path / ".metadata", *path.glob("*.distcp")]:
            f.unlink(missing_ok=True)
    comm.barrier()


def load(path: str | Path, engine: Engine, opt: Any) -> None:
    """Loads a checkpoint written by `save` at any world size and shard size into this
    engine's parameters, persistent buffers and optimizer state (collective). The optimizer's hyperparameters
    (lr, ...) stay as constructed."""
    import torch.distributed.checkpoint as dcp

    state = {**_state(engine, opt), **_buffer_state(engine, saving=False)}
    _check_buffers(path, state)
    with torch.no_grad(), warnings.catch_warnings():  # as in `save`: one process may load
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=not comm.is_distributed())
        opt.num_steps = int(state[STEPS_KEY][0])
        after_load(engine, opt)


def after_load(engine: Engine, opt: Any) -> None:
    """Makes the parameters agree with the loaded master values: with shard_size 1 the master
    shard is copied into the parameters (bf16 models) and all-gathered; with shard_size > 1 the
    loaded pieces are all-gathered over the replicas into the block shards."""
    from dcparallel.runtime.sharded_optim import ShardedAdamW

    if isinstance(opt, ShardedAdamW):
        opt.sync_replicas()
    else:
        opt.sync_params()


# the names the tensor-only API is also known by
save_sharded, load_sharded = save, load


# ---------------------------------------------------------------- reading without an engine


_SAFE_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.storage",
)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch.Size / dtypes / layouts / memory formats, paths and plain
    containers; anything else (code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        ):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # a layout by its name
            return super().find_class(module, name)
        if module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)  # the checkpoint's id (its folder)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module in ("builtins", "copyreg") and name in (
            "set",
            "frozenset",
            "tuple",
            "list",
            "dict",
            "_reconstructor",
            "object",
            "getattr",
            "slice",
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the checkpoint metadata names {module}.{name}, which is not part of "
            f"torch.distributed.checkpoint's metadata; refusing to load it"
        )


def _safe_reader_cls():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader


def SafeReader(path: str | Path):  # noqa: N802 - a class factory (torch imported lazily)
    """A `torch.distributed.checkpoint.FileSystemReader` of ``path`` whose metadata is read
    with a restricted unpickler (module docstring)."""
    return _safe_reader_cls()(str(path))


def _tensor_metadata(path: str | Path) -> dict[str, Any]:
    """DCP's metadata of every tensor of a checkpoint folder, by key."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = SafeReader(path).read_metadata()
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def read_keys(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The tensor keys of a checkpoint folder and their shapes (no process group needed)."""
    return {k: tuple(v.size) for k, v in _tensor_metadata(path).items()}


def read_state(path: str | Path, prefix: str = "") -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder whose key starts with ``prefix``, whole, on the CPU,
    in one process (no process group needed), keyed as saved, in its saved dtype (fp32 values
    and moments; ``optim/num_steps`` int64; buffers their own)."""
    import torch.distributed.checkpoint as dcp

    metas = _tensor_metadata(path)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in metas.items() if k.startswith(prefix)}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    return state


def read_model(path: str | Path) -> dict[str, Tensor]:
    """Every ``model/<name>`` tensor of a checkpoint folder (`read_state`): the trained
    parameters by name (fp32)."""
    return {k[len("model/") :]: v for k, v in read_state(path, "model/").items()}


def read_buffers(path: str | Path) -> dict[str, Tensor]:
    """Every ``buffer/<name>`` tensor of a checkpoint folder (`read_state`): the persistent
    buffers by name, in their own dtype (a 0-d buffer with one dimension of 1)."""
    return {k[len(BUFFER_PREFIX) :]: v for k, v in read_state(path, BUFFER_PREFIX).items()}
