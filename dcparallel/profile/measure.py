"""How one run of a layout is measured: depth skipping, timing, peak memory, the fake limit.

Memory, per device:

* CUDA: the allocator's peak (`torch.cuda.max_memory_allocated`) minus what was allocated
  before the forward (parameters, gradient buffer, optimizer state): the activations and
  transients of one forward + backward. The reserved peak and ``torch.cuda.mem_get_info``
  are read with it; the profile's stats keep the worst of them (`cuda_run_memory`).
* CPU: there is no allocator to ask, so the profiler estimates. `SavedTensorMeter` counts the
  bytes autograd saves for backward during the forward (`saved_tensors_hooks`), each storage
  once (views of one storage, e.g. q/k/v split from one projection, count once), parameters
  excluded. Nothing saved is freed before backward starts, so this total is the peak of the
  saved activations. Not counted: the transient of a recomputed block during backward, the
  gradients of activations in flight, and temporaries no backward needs. Model states (the
  profile's ``model_state_bytes``) are added by the planner. It is an estimate, never zero:
  a forward that saves nothing raises.

A fake allocator limit: the meter's ``limit_bytes`` (the profiler's ``memory_limit``) makes
the CPU behave like a device of that size. When model states + saved activations pass it,
the meter raises `torch.OutOfMemoryError` inside the forward, where a device would fail, so
out-of-memory handling runs for real and a CPU run can emulate a device's memory.
"""

from __future__ import annotations

import contextlib
import gc
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from dcparallel.cost.schema import ProfileEntry
from dcparallel.runtime import comm
from dcparallel.runtime.launch import cuda_memory


def extrapolate(v1: float, v2: float, num_layers: int, d1: int = 1, d2: int = 2) -> float:
    """Value of a ``num_layers`` stack from stacks of ``d1`` and ``d2`` layers, linear in depth:
    ``v2 + (num_layers - d2) * (v2 - v1) / (d2 - d1)``; with d1=1, d2=2 this is
    ``t_L = t2 + (L - 2)(t2 - t1)``."""
    if not 1 <= d1 < d2:
        raise ValueError(f"extrapolation needs depths 1 <= d1 < d2; got d1={d1}, d2={d2}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1; got {num_layers}")
    return v2 + (num_layers - d2) * (v2 - v1) / (d2 - d1)


@contextlib.contextmanager
def active_depth(layers: Sequence[nn.Module], depth: int, skip: Callable | None = None) -> Iterator[None]:
    """Runs only ``layers[:depth]``: every later layer passes its hidden state (its first
    argument, or its ``hidden_states`` keyword) through unchanged until the block exits. A
    later layer wrapped by FSDP2 (shard blocks, `runtime.sharded`) has its forward hooks
    suspended too, so it gathers no parameters and reduces no gradients: a stack of d layers
    costs d layers' collectives, and the depth extrapolation adds one layer's per layer.
    Layers must be residual blocks that return the new hidden state, or pass ``skip(*args,
    **kwargs)`` (`ModelAdapter.skip_block`): what a skipped block returns (e.g. a block that
    returns a tuple of streams)."""
    if not 1 <= depth <= len(layers):
        raise ValueError(f"depth {depth} is outside 1..{len(layers)} (the number of layers)")
    saved: list[tuple[nn.Module, object]] = []

    def passthrough(*args, **kwargs):
        if skip is not None:
            return skip(*args, **kwargs)
        if args:
            return args[0]
        return kwargs["hidden_states"] if "hidden_states" in kwargs else next(iter(kwargs.values()))

    passthrough.skips_block = True  # the engine's attention check does not count a skipped block as run
    hooks: list[tuple[nn.Module, dict, dict]] = []
    try:
        for layer in layers[depth:]:
            saved.append((layer, layer.__dict__.get("forward")))  # the engine's wrapper, if any
            layer.forward = passthrough
            if _is_fsdp(layer):  # a skipped block gathers no parameters and reduces no gradients
                hooks.append((layer, dict(layer._forward_pre_hooks), dict(layer._forward_hooks)))
                layer._forward_pre_hooks.clear()
                layer._forward_hooks.clear()
        yield
    finally:
        for layer, pre, post in hooks:
            layer._forward_pre_hooks.update(pre)  # in their order (FSDP's pre-forward hook is prepended)
            layer._forward_hooks.update(post)
        for layer, fwd in saved:
            if fwd is None:
                del layer.forward
            else:
                layer.forward = fwd


def _is_fsdp(module: nn.Module) -> bool:
    """True for a block wrapped by FSDP2's ``fully_shard`` (`runtime.sharded`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed support has no FSDP
        return False
    return isinstance(module, FSDPModule)


class SavedTensorMeter:
    """Counts bytes saved for backward (unique storages, parameters and autocast's 16-bit
    copies of them excluded: model states) while active;
    raises `torch.OutOfMemoryError` when ``base_bytes`` + the count passes ``limit_bytes``.
    ``exclude``: tensors whose storages are not activations (the parameter buffers).
    ``skip_parameters``: also every saved `nn.Parameter` and view of one, whatever its
    storage — the whole parameters FSDP2 gathers for a layer's forward live in storages made
    and freed per layer (counted by the profiler as model states, `cost.base.gathered_bytes`)."""

    def __init__(
        self,
        exclude: Sequence[Tensor] = (),
        base_bytes: float = 0.0,
        limit_bytes: float | None = None,
        skip_parameters: bool = False,
    ):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._skip_parameters = skip_parameters
        self._seen: set[int] = set()
        self.base_bytes = float(base_bytes)
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Tensor:
        if self._skip_parameters and (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            return t
        if _cast_of_parameter(t):  # autocast's weight copy: a model state (`cost.base.StateRecipe.autocast`)
            return t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        key = storage.data_ptr()
        if key in self._exclude or key in self._seen or storage.nbytes() == 0:
            return t
        self._seen.add(key)
        self.bytes += storage.nbytes()
        if self.limit_bytes is not None and self.base_bytes + self.bytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"fake memory limit: {self.base_bytes + self.bytes:,.0f} bytes (model states "
                f"{self.base_bytes:,.0f} + saved activations {self.bytes:,}) > limit {self.limit_bytes:,.0f}"
            )
        return t

    @staticmethod
    def _unpack(t: Tensor) -> Tensor:
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _cast_of_parameter(t: Tensor) -> bool:
    """Whether ``t`` is (a view of) a dtype cast of a trainable parameter (its autograd node a
    copy whose input is the parameter's gradient accumulator): autocast's 16-bit weight copy,
    which a matmul saves transposed. A frozen parameter's copy has no autograd node and is
    counted as an activation (over-counted)."""
    node = (t._base if t._base is not None else t).grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return False
    source = node.next_functions[0][0] if node.next_functions else None
    return isinstance(getattr(source, "variable", None), nn.Parameter)


class Timer:
    """perf_counter on CPU; CUDA events (after a synchronize) on GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], None]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def free_memory(device: torch.device) -> None:
    """After an out-of-memory: drop what the failed run left (graph, saved tensors)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {name}"


def grad_sync_seconds(flat_grad: Tensor, timer: Timer, group=comm.WORLD) -> float:
    """The step's one all-reduce of the flat gradient buffer over ``group`` (the world; with
    shard blocks the replicas of this rank's shard, None when there is one block), measured:
    the median of three timed rounds after a warm-up, the slowest rank's (0 on one rank). The
    ranks line up for each round, and exchange their times, on the control group."""
    if comm.world_size() == 1 or group is None:
        return 0.0
    times = []
    for i in range(4):
        comm.barrier(comm.control_group())
        t = timer.time(lambda: comm.all_reduce_(flat_grad, group))
        if i:
            times.append(t)
    flat_grad.zero_()
    return max(comm.all_gather_object(median(times), comm.control_group()))


def group_entry(
    entry: ProfileEntry,
    res: Sequence[dict],
    d1: int,
    d2: int,
    num_layers: int,
    state_bytes: float,
    memory_limit: float | None,
) -> bool:
    """Fills ``entry`` from its SP group's per-rank measurements ``res`` (`Profiler._measure`):
    out of memory if any rank was; else the full-depth time and memory extrapolated from the
    stacks of ``d1`` and ``d2`` layers (the slowest rank's time, the largest rank's memory),
    infeasible when model states + activations pass ``memory_limit``. Returns True when the
    per-layer time was clamped at zero."""
    if not all(r["ok"] for r in res):
        entry.feasible, entry.reason = False, "oom"
        entry.error = next(r["error"] for r in res if not r["ok"])
        return False
    L = num_layers
    t = {d: max(r["time"][d] for r in res) for d in res[0]["time"]}
    m = {d: max(r["memory"][d] for r in res) for d in res[0]["time"]}
    # t_L = t2 + (L - d2) x (time of one layer); the layer's time is the median of the
    # per-round differences (t2 - t1) / (d2 - d1): both depths of a round run back to back,
    # so load drifting on a shared machine cancels in each pair
    slope = max(r["slope"] for r in res)
    clamped = slope < 0  # noise larger than a layer: no per-layer time resolved
    slope = max(slope, 0.0)
    m_l = max(extrapolate(m[d1], m[d2], L, d1, d2), m[d2])
    entry.time_s, entry.memory_bytes = t[d2] + (L - d2) * slope, m_l
    entry.feasible = memory_limit is None or state_bytes + m_l <= memory_limit
    entry.time_spread, entry.rounds, entry.rejected = (  # the slowest rank's time is kept
        max(r["spread"] for r in res),
        res[0]["rounds"],
        max(r["rejected"] for r in res),
    )
    entry.measured = {"depths": [d1, d2], "time_s": [t[d1], t[d2]], "layer_s": slope, "memory_bytes": [m[d1], m[d2]]}
    ref = [r.get("reference_s") for r in res]
    if all(ref):  # the group's ranks share the machine: their mean reference time
        entry.measured["reference_s"] = sum(ref) / len(ref)
    if not entry.feasible:
        entry.reason = "over_budget"
    if L in t and L > d2:
        entry.validation = {"time_s": t[L], "memory_bytes": m[L]}
    elif res[0].get("validation_error"):
        entry.validation = {"error": res[0]["validation_error"]}
    return clamped


def cuda_run_memory(device: torch.device, run: Callable[[], None]) -> tuple[float, dict]:
    """Runs ``run`` once on CUDA: the bytes its peak allocated above what was allocated
    before (activations and transients), and `launch.cuda_memory` after it (the allocated
    and reserved peaks, the device's free and total memory)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    seen = cuda_memory(device)
    return float(seen["measured_peak_memory_bytes"] - base), seen


def worst_cuda_memory(a: dict | None, b: dict) -> dict:
    """Of two `launch.cuda_memory` readings, the larger peaks and the smaller free memory."""
    if a is None:
        return dict(b)
    return {k: (min if k == "device_free_bytes" else max)(a[k], b[k]) for k in b}
