"""Every collective of dcparallel lives here.

A ``group`` of None means "no process group" (a single-rank world or a group of one rank):
each function then does the single-rank thing without calling torch.distributed. The
object helpers (`all_gather_object`, `check_equal`, `barrier`) default to `WORLD`, every rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dcparallel.runtime import compat

#: the whole world as a ``group`` argument (None would mean a one-rank group)
WORLD = "world"


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group) -> int:
    if group is None or not is_distributed():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group`` (0 without a process group)."""
    if group is None or not is_distributed():
        return 0
    return dist.get_rank(group)


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def world_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


# ---------------------------------------------------------------- the control group

#: seconds a collective of the control group may wait (env DCPARALLEL_CONTROL_TIMEOUT_S)
DEFAULT_CONTROL_TIMEOUT_S = 1800.0

_control: dict[int, Any] = {}


def control_timeout_s() -> float:
    """The control group's collective timeout: ``DCPARALLEL_CONTROL_TIMEOUT_S`` or 30 min."""
    raw = os.environ.get("DCPARALLEL_CONTROL_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else DEFAULT_CONTROL_TIMEOUT_S
    except ValueError:
        raise ValueError(f"DCPARALLEL_CONTROL_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"DCPARALLEL_CONTROL_TIMEOUT_S={raw!r} must be > 0 seconds")
    return value


def control_group():
    """A gloo (CPU) process group of the whole world for agreements and object exchanges:
    profiling's turn-taking, configuration and plan digests, checkpoint commits.

    It is apart from the training collectives for two reasons: objects and small flags need
    no CUDA tensors (an object collective on NCCL copies to the GPU and synchronizes), and a
    rank that waits here for a slower rank (one profiling the busiest group, one writing a
    checkpoint) waits under this group's long timeout (`control_timeout_s`), not the NCCL
    watchdog's. Collective on first use: every rank must make its first call at the same
    point. None in a one-rank world (the object helpers then do the single-rank thing)."""
    if world_size() == 1:
        return None
    key = id(dist.group.WORLD)  # a new default group (re-initialized world) gets a new one
    if key not in _control:
        _control.clear()
        _control[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s()))
    return _control[key]


# ---------------------------------------------------------------- a check before a run's collectives

_guards: list[Callable[[], None]] = []


@contextlib.contextmanager
def collective_guard(check: Callable[[], None]) -> Iterator[None]:
    """While active, ``check()`` runs before each collective of a micro-batch's autograd ops
    (the Ulysses all-to-alls and sequence gathers, forward, backward and recomputed forward),
    after its output is allocated. The profiler's untimed runs agree there, on a control
    group, that no rank of the SP group has stopped (`profile.control.run_together`); an
    exception from ``check`` ends the run on this rank. A module-level stack, not a thread
    local: a CUDA backward runs on autograd's device thread."""
    _guards.append(check)
    try:
        yield
    finally:
        _guards.pop()


def _before_collective() -> None:
    if _guards:
        _guards[-1]()


# ---------------------------------------------------------------- Ulysses all-to-alls


class _AllToAll(torch.autograd.Function):
    """Even-split all_to_all_single over dim 0. The adjoint of an even all-to-all (chunk j of
    rank i goes to slot i of rank j) is the same all-to-all, so backward repeats it on the
    gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        _before_collective()
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        _before_collective()
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all(x: Tensor, group) -> Tensor:
    """Autograd-correct all-to-all: dim 0 (size = group size) indexes the peer."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group)


def seq_to_heads(xs: list[Tensor], group) -> list[Tensor]:
    """Sequence-sharded (B, L/sp, H_i, D_i) tensors -> head-sharded (B, L, H_i/sp, D_i), all
    in one all-to-all (each peer's head slices of every tensor travel together). The tensors
    may have different head counts (query vs grouped key/value heads), each divisible by sp,
    and different head sizes (multi-head latent attention: values unlike queries and keys).
    Rank p of the group receives heads p*H_i/sp .. (p+1)*H_i/sp - 1 of each tensor."""
    sp = group_size(group)
    if sp == 1:
        return list(xs)
    b, ls = xs[0].shape[:2]
    shapes = [(x.shape[2] // sp, x.shape[3]) for x in xs]
    widths = [h * d for h, d in shapes]
    # (B, Ls, sp, H_i/sp * D_i) per tensor, joined on the per-peer axis
    x = torch.cat([t.reshape(b, ls, sp, w) for t, w in zip(xs, widths, strict=True)], dim=3)
    y = all_to_all(x.permute(2, 0, 1, 3), group)  # (peer=sequence shard, B, Ls, sum widths)
    y = y.permute(1, 0, 2, 3).reshape(b, sp * ls, sum(widths))
    return [part.reshape(b, sp * ls, h, d) for part, (h, d) in zip(y.split(widths, dim=2), shapes, strict=True)]


def heads_to_seq(x: Tensor, group) -> Tensor:
    """(B, L, H/sp, D) head-sharded -> (B, L/sp, H, D) sequence-sharded."""
    sp = group_size(group)
    if sp == 1:
        return x
    b, n, hs, d = x.shape
    x = x.reshape(b, sp, n // sp, hs, d).permute(1, 0, 2, 3, 4)  # (peer=sequence shard, B, Ls, Hs, D)
    y = all_to_all(x, group)  # (peer=head group, B, Ls, Hs, D)
    return y.permute(1, 2, 0, 3, 4).reshape(b, n // sp, sp * hs, d)


class _GatherSeq(torch.autograd.Function):
    """All-gather of equal shards along ``dim``. Every rank then computes on the whole
    tensor, so the gradient of a shard is the sum over ranks of that slice of theirs: an
    all-reduce of the gradient, then this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        _before_collective()
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        _before_collective()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n), None, None


def gather_seq(x: Tensor, group, dim: int = 1) -> Tensor:
    """Sequence shards (equal sizes) -> the whole padded sequence on every rank of the group
    (autograd: see `_GatherSeq`)."""
    if group_size(group) == 1:
        return x
    return _GatherSeq.apply(x, group, dim)


# ---------------------------------------------------------------- ring attention's point-to-point


class RingShift:
    """One ring step in flight: ``tensor`` sent to the next rank of a ring while a tensor
    of the same shape comes from the previous one; `wait` returns it. ``send_to`` and
    ``recv_from`` are global ranks. A CUDA tensor on a gloo group goes through host memory
    (gloo's send and receive take host buffers)."""

    def __init__(self, tensor: Tensor, send_to: int, recv_from: int, group):
        _before_collective()
        self._device = None
        if tensor.is_cuda and dist.get_backend(group) == "gloo":
            self._device, tensor = tensor.device, tensor.cpu()
        self.received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), send_to, group),
            dist.P2POp(dist.irecv, self.received, recv_from, group),
        ]
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> Tensor:
        for r in self._requests:
            r.wait()
        return self.received if self._device is None else self.received.to(self._device)


# ---------------------------------------------------------------- gradients and parameters


def all_reduce_sum_(t: Tensor) -> Tensor:
    """In-place sum over the whole world (no-op on a single rank)."""
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_sum_async(t: Tensor, group=None):
    """Starts an in-place sum of ``t`` over ``group`` (default: the world); returns a handle
    for `wait` (None on a single rank: nothing to wait for)."""
    if world_size() == 1:
        return None
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_sum_async(t: Tensor, owner: int, group=None):
    """Starts a sum of ``t`` over ``group`` (default: the world) into rank ``owner`` of the
    group (the others' ``t`` is unspecified afterwards); a handle for `wait` (None on a single
    rank)."""
    if world_size() == 1:
        return None
    dst = owner if group is None else dist.get_global_rank(group, owner)
    return dist.reduce(t, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)


def world_group():
    """The default group as a ``group`` argument of the functions that take a real group
    (None without a process group: a one-rank world)."""
    return dist.group.WORLD if is_distributed() else None


def all_reduce_(t: Tensor, group, op: str = "sum") -> Tensor:
    """In-place sum (``op="max"``: maximum) of ``t`` over ``group`` (`WORLD`: every rank;
    None: a one-rank group, nothing to do)."""
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    if group is WORLD:
        if world_size() > 1:
            dist.all_reduce(t, op=red)
    elif group_size(group) > 1:
        dist.all_reduce(t, op=red, group=group)
    return t


def all_gather_flat(t: Tensor, group) -> Tensor:
    """Every rank's ``t`` (equal sizes) of ``group``, concatenated in rank order as one 1-D
    tensor (None: a one-rank group, ``t`` flattened)."""
    n = group_size(group)
    if n == 1:
        return t.reshape(-1)
    out = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
    compat.all_gather_into_tensor(out, t.contiguous().reshape(-1), group)
    return out


def all_to_all_bytes(parts: list[Tensor], recv_sizes: list[int], group=WORLD) -> list[Tensor]:
    """One variable-size all-to-all of 1-D uint8 buffers: ``parts[j]`` goes to rank j of
    ``group`` (default: the whole world); returns what each rank sent here, ``recv_sizes[j]``
    bytes from rank j (every rank computes those from what it already knows)."""
    n = world_size() if group is WORLD else group_size(group)
    assert len(parts) == len(recv_sizes) == n, (len(parts), len(recv_sizes), n)
    if n == 1:
        return [parts[0]]
    send = torch.cat(parts)
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(
        out,
        send,
        output_split_sizes=list(recv_sizes),
        input_split_sizes=[p.numel() for p in parts],
        group=None if group is WORLD else group,
    )
    return list(out.split(list(recv_sizes)))


def wait(handle) -> None:
    if handle is not None:
        handle.wait()


def all_gather_shards_(flat: Tensor, shard_numel: int, group=WORLD) -> Tensor:
    """Rank i of ``group`` (default: the whole world; None: a one-rank group) holds
    ``flat[i*shard_numel:(i+1)*shard_numel]`` up to date; afterwards every rank holds all of
    ``flat``. In place (ZeRO-1's post-step parameter all-gather): the input is this rank's
    slice of the output, the form NCCL's all-gather runs without a temporary (gloo too)."""
    n = world_size() if group is WORLD else group_size(group)
    if n == 1:
        return flat
    i = world_rank() if group is WORLD else group_rank(group)
    out = flat[: n * shard_numel]
    compat.all_gather_into_tensor(out, out[i * shard_numel : (i + 1) * shard_numel], None if group is WORLD else group)
    return flat


# ---------------------------------------------------------------- helpers for loader / profiler


def all_gather_object(obj: Any, group=WORLD) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of ``group`` (default:
    the whole world; None: a one-rank group)."""
    n = world_size() if group is WORLD else group_size(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj, group=None if group is WORLD else group)
    return out


def gather_dict(d: dict, group=WORLD) -> dict[int, dict]:
    """{rank: that rank's dict} on every rank (e.g. the profiler's measurements)."""
    return dict(enumerate(all_gather_object(d, group)))


def digest(obj: Any) -> str:
    """A short stable hash of a picklable object (plans, configs)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=4)).hexdigest()[:16]


def check_equal(value: str, what: str = "value", group=WORLD) -> None:
    """Raises RuntimeError on every rank unless ``value`` (e.g. a plan hash) is the same on
    all ranks; the message names which ranks hold which value."""
    values = all_gather_object(value, group)
    if len(set(values)) <= 1:
        return
    by_value: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    detail = "; ".join(f"ranks {rs}: {v!r}" for v, rs in by_value.items())
    raise RuntimeError(f"{what} differs across ranks ({detail}); every rank must build the same {what}")


def barrier(group=WORLD) -> None:
    if group is WORLD:
        if is_distributed():
            dist.barrier()
    elif group_size(group) > 1:
        dist.barrier(group=group)


def check_agree(fields: dict[str, tuple[Any, str]], what: str, group=WORLD) -> None:
    """Raises ValueError on every rank of ``group`` unless each of ``fields`` (name -> (value,
    the fix to name when it differs)) is the same on all its ranks. One object exchange of
    digests and short previews; the message names the first field that differs, which ranks
    hold which value, and its fix."""
    mine = {name: (digest(value), repr(value)[:160]) for name, (value, _) in fields.items()}
    every = all_gather_object(mine, group)
    for name, (_, fix) in fields.items():
        by_value: dict[str, tuple[str, list[int]]] = {}
        for r, theirs in enumerate(every):
            d, preview = theirs[name]
            by_value.setdefault(d, (preview, []))[1].append(r)
        if len(by_value) > 1:
            detail = "; ".join(f"ranks {_ranks_text(rs)}: {preview}" for preview, rs in by_value.values())
            raise ValueError(
                f"{what}: {name} differs across ranks ({detail}); every rank must plan from the same {name}: {fix}"
            )


def _ranks_text(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, {ranks[1]}, ... {ranks[-1]}] ({len(ranks)} ranks)"
