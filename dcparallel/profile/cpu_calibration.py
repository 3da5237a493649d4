"""The analytic cost model calibrated on this CPU (``cost = "analytic"`` on a CPU launch).

The packaged `cost.analytic.Calibration` is fitted to an H200; a CPU run priced by it plans
with GPU proportions (launch floors, matmul vs attention rates) that are not the CPU's. Here a
few timings on this machine, a few seconds for a small model, replace its time constants:

* linear work: forward + backward of one layer's matmuls at the model's sizes (an input and
  an output projection of ``attn_params``, a gated MLP of ``mlp_params``, two RMS norms and
  the residual adds) on N and 4N tokens: seconds per token (the slope); on 16 tokens, less
  16 tokens' work: a floor (timed where it is nearly the whole time, not an intercept
  extrapolated from two larger timings, which their noise would swamp);
* attention: `scaled_dot_product_attention` (causal, one document, 4-D, the model's heads
  and head size) forward + backward at L and 4L tokens: seconds per query-key pair; at 16
  tokens, its floor added to the floor.

Each size is timed in processor seconds (`time.process_time`: what the work costs, whatever
share of the cores the process gets meanwhile): five rounds of one window of at least 0.15 s
of wall time per size after a warm-up call, the median of each size's windows' means per
call (`robust_times`). The share
of the cores the process had over the whole calibration (its processor seconds over its wall
seconds, about 5 s) turns them into wall seconds, the unit of a step's time: on a machine
shared with other work, two timings taken under different loads do not make a slope of
noise, and the load enters once, averaged over seconds. N and L shrink for large models so
that one call stays well under a second. Memory constants (bytes per token: the model's, not the
device's) and the recompute fractions stay the packaged calibration's. The smooth max of
floor and compute becomes a sum (p = 1: a CPU has no idle launch time to hide work in).

`cpu_calibration` caches the constants in a JSON file (``cpu-calibration.json`` beside the
profile path) keyed by the CPU, threads, torch version and the model's sizes. Under
torchrun every rank times at once, loading the machine as training does, and every rank
uses the ranks' mean, so their cost models are the same. With more than one rank the
launch's links are timed too (`cpu_cluster`, `profile.cpu_links`: gloo's all-to-all latency
and bandwidth at the world size, cached in the same file) and price the all-to-alls and the
gradient sync in place of the GPU link speeds a CPU launch is given.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dcparallel.cost.analytic import AnalyticCost, Calibration, fit_calibration
from dcparallel.profile import cpu_links
from dcparallel.runtime import comm
from dcparallel.spec import ClusterSpec, ModelSpec

log = logging.getLogger(__name__)

#: the cache's file name, beside the profile path
CACHE_NAME = "cpu-calibration.json"
#: floating-point operations of one call at the larger timed size (tens of milliseconds on one core)
TIMING_FLOPS = 2e9
#: windows each size is timed in, and the least wall seconds of one (`robust_times`): six
#: sizes take about 6 x (5 x 0.15 + a warm-up call) = 5 s
REPEATS, MIN_S = 5, 0.15
#: tokens of the smallest timings, whose time is nearly all the floor
FLOOR_TOKENS = 16


def robust_times(
    fns, repeats: int | None = None, min_s: float | None = None, clock=time.perf_counter, work_clock=None
) -> list[float]:
    """Seconds of ``work_clock`` (default ``clock``) one call of each of ``fns`` takes: after a
    warm-up call of each, ``repeats`` rounds of one window per function, a window at least
    ``min_s`` seconds of ``clock`` (as many calls as fill one); per function the median of its
    windows' means per call. A window spans many of the scheduler's time slices, the median
    drops a window a burst of other work fell into, and the rounds give every function the
    same mix of the machine's load. ``repeats`` and ``min_s`` default to `REPEATS` and `MIN_S`."""
    repeats, min_s = repeats or REPEATS, MIN_S if min_s is None else min_s
    work_clock = work_clock or clock
    for fn in fns:
        fn()  # warm-up
    means: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, mine in zip(fns, means, strict=True):
            calls, t0, w0 = 0, clock(), work_clock()
            while True:
                fn()
                calls += 1
                if clock() - t0 >= min_s:
                    break
            mine.append((work_clock() - w0) / calls)
    return [statistics.median(m) for m in means]


def robust_time(fn, **kw) -> float:
    """`robust_times` of one function."""
    return robust_times([fn], **kw)[0]


def _tokens(flops_per_token: float, cap: int) -> int:
    """A power of two of tokens whose timing costs about `TIMING_FLOPS` (64 to ``cap``)."""
    n = max(64.0, min(float(cap), TIMING_FLOPS / max(flops_per_token, 1.0)))
    return 2 ** int(math.log2(n))


def _layer_linear(spec: ModelSpec, dtype: torch.dtype):
    """fn(n) -> a call of forward + backward of one layer's linear work on n tokens."""
    h = spec.hidden
    a_out = max(1, spec.attn_params // h - h)  # q, k, v (in) ... and the output projection (h x h)
    f = max(1, spec.mlp_params // (3 * h))  # gate, up, down
    g = torch.Generator().manual_seed(0)
    ws = [
        torch.randn(h, a_out, generator=g, dtype=dtype) / math.sqrt(h),
        torch.randn(h, h, generator=g, dtype=dtype),
        torch.randn(h, 2 * f, generator=g, dtype=dtype) / math.sqrt(h),
        torch.randn(f, h, generator=g, dtype=dtype),
    ]
    for w in ws:
        w.requires_grad_(True)

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def fn(n: int):
        x = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)

        def run():
            y = x + (rms(x) @ ws[0])[:, :h] @ ws[1]
            gate, up = (rms(y) @ ws[2]).chunk(2, dim=-1)
            out = y + (F.silu(gate) * up) @ ws[3]
            out.sum().backward()

        return run

    return fn


def _attention(spec: ModelSpec, dtype: torch.dtype):
    """fn(L) -> a call of forward + backward of causal attention over one document of L tokens."""
    heads = spec.num_heads
    d = spec.head_dim or spec.hidden // heads
    g = torch.Generator().manual_seed(1)

    def fn(length: int):
        q, k, v = (torch.randn(1, heads, length, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))

        def run():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        return run

    return fn


def measure(spec: ModelSpec) -> dict:
    """This machine's time constants for ``spec``'s layer (seconds; see the module doc)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    dtype = torch.float32 if spec.bytes_per_value >= 4 else torch.bfloat16
    params = spec.attn_params + spec.mlp_params
    n = _tokens(6.0 * params, 4096) // 4  # the larger timing, 4n tokens, about TIMING_FLOPS
    length = _tokens(6.0 * spec.hidden * math.sqrt(TIMING_FLOPS / (6.0 * spec.hidden)), 4096) // 4  # 6 h (4L)^2 flops
    lin, att = _layer_linear(spec, dtype), _attention(spec, dtype)
    fns = [lin(FLOOR_TOKENS), lin(n), lin(4 * n), att(FLOOR_TOKENS), att(length), att(4 * length)]
    t0, t1, t2, a0, a1, a2 = robust_times(fns, work_clock=time.process_time)
    per_token = max((t2 - t1) / (3 * n), t2 / (4 * n) * 0.5)
    p0, p1, p2 = (x * (x + 1) / 2 for x in (FLOOR_TOKENS, length, 4 * length))
    per_pair = max((a2 - a1) / (p2 - p1), 0.0)
    floor = max(0.0, t0 - per_token * FLOOR_TOKENS) + max(0.0, a0 - per_pair * p0)
    share = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)  # of the cores it had
    return {
        "lin_s_per_token": per_token / share,
        "attn_s_per_pair": per_pair / share,
        "floor_s": floor / share,
        "cpu_share": share,
        "timed_tokens": [n, 4 * n],
        "timed_lengths": [length, 4 * length],
    }


def calibration(spec: ModelSpec, measured: dict) -> Calibration:
    """The packaged calibration with ``measured``'s time constants (of ``spec``'s layer),
    expressed for its reference block as `AnalyticCost` scales them back to ``spec``."""
    base = fit_calibration("llama-7b")
    ref = base.ref
    ref_params = ref.attn_params + ref.mlp_params + ref.other_params
    params = spec.attn_params + spec.mlp_params + spec.other_params
    return dataclasses.replace(
        base,
        name="cpu",
        p=1.0,
        floor_s=float(measured["floor_s"]),
        lin_s_per_token=float(measured["lin_s_per_token"]) * ref_params / params,
        attn_s_per_pair=float(measured["attn_s_per_pair"])
        * (ref.hidden * ref.attn_per_layer)
        / (spec.hidden * spec.attn_per_layer),
        time_err_mean=0.0,
        time_err_max=0.0,
        num_rows=0,
    )  # nothing fitted: timed


def _cpu_name() -> str:
    try:
        return next(
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        )
    except (OSError, StopIteration):
        return "cpu"


def _key(spec: ModelSpec) -> str:
    return json.dumps(
        [
            _cpu_name(),
            torch.get_num_threads(),
            torch.__version__,
            comm.world_size(),
            spec.hidden,
            spec.ffn_hidden,
            spec.num_heads,
            spec.head_dim,
            spec.attn_params,
            spec.mlp_params,
            spec.bytes_per_value,
        ]
    )


def cpu_calibration(spec: ModelSpec, cache: str | Path | None) -> Calibration:
    """The calibration of ``spec`` on this CPU: from ``cache`` (a JSON file) when it holds this
    machine's and model's constants, else timed now on every rank (collective) and saved there
    by rank 0. The same on every rank."""
    key, path = _key(spec), Path(cache) if cache is not None else None
    saved = _load(path)
    hit = saved.get(key)
    if not all(comm.all_gather_object(hit is not None)):
        t0 = time.perf_counter()
        mine = measure(spec)
        every = comm.all_gather_object(mine)
        hit = {k: statistics.fmean(m[k] for m in every) for k in ("lin_s_per_token", "attn_s_per_pair", "floor_s")}
        if comm.world_rank() == 0:
            log.info(
                "calibrated the analytic cost model on this CPU in %.1f s: %.3g s per token of linear work, "
                "%.3g s per attention pair, floor %.3g s per layer (cached in %s)",
                time.perf_counter() - t0,
                hit["lin_s_per_token"],
                hit["attn_s_per_pair"],
                hit["floor_s"],
                path,
            )
            _save(path, key, hit)
    hit = comm.all_gather_object(hit)[0]  # rank 0's (every rank's when they all read the same file)
    return calibration(spec, hit)


def _load(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}


def _save(path: Path | None, key: str, entry: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**_load(path), key: entry}, indent=1))


def cpu_cluster(cluster: ClusterSpec, cache: str | Path | None) -> ClusterSpec:
    """``cluster`` with this launch's links (`profile.cpu_links`): from ``cache`` when it holds
    this machine's at this world size, else timed now on every rank (collective) and saved
    there by rank 0. Unchanged in a world of one rank. The same on every rank."""
    if comm.world_size() < 2:
        return cluster
    key, path = (
        json.dumps(["links", _cpu_name(), torch.__version__, comm.world_size()]),
        Path(cache) if cache is not None else None,
    )
    hit = _load(path).get(key)
    if not all(comm.all_gather_object(hit is not None)):
        hit = cpu_links.measure_links()
        if comm.world_rank() == 0:
            log.info(
                "timed this launch's links for the analytic cost model: %.3g bytes/s, latency %.3g s (cached in %s)",
                hit["bw"],
                hit["latency"],
                path,
            )
            _save(path, key, hit)
    return cpu_links.with_links(cluster, comm.all_gather_object(hit)[0])


def analytic_cost(
    spec: ModelSpec, cluster: ClusterSpec, device: torch.device, profile_path: str | Path
) -> AnalyticCost:
    """``cost = "analytic"``: the packaged calibration on a GPU, this CPU's and this launch's
    links (`cpu_cluster`; both cached beside ``profile_path``) on a CPU unless
    ``DCPARALLEL_CPU_CALIBRATION=0`` asks for the packaged one (plans that do not depend on
    the machine's timings: the tests'). Collective on a CPU."""
    on = device.type == "cpu" and os.environ.get("DCPARALLEL_CPU_CALIBRATION", "1") != "0"
    if not on:
        return AnalyticCost(spec, cluster)
    cache = Path(profile_path).with_name(CACHE_NAME)
    return AnalyticCost(spec, cpu_cluster(cluster, cache), cpu_calibration(spec, cache))
