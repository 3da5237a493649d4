"""The analytic cost model calibrated on this CPU (``cost = "analytic"`` on a CPU launch).

The packaged `cost.analytic.Calibration` is fitted to an H200; a CPU run priced by it plans
with GPU proportions (launch floors, matmul vs attention rates) that are not the CPU's. Here a
few timings on this machine, a few seconds for a small model, replace its time constants:

* linear work: forward + backward of one layer's matmuls at the model's sizes (an input and
  an output projection of ``attn_params``, a gated MLP of ``mlp_params``, two RMS norms and
  the residual adds) on n, 2n and 4n tokens: seconds per token (the least-squares slope); on
  16 tokens, less 16 tokens' work: a floor (timed where it is nearly the whole time, not an
  intercept extrapolated from larger timings, which their noise would swamp);
* attention: the kernel the runtime runs on a CPU (`models.attention.default_kernel`: SDPA,
  causal, one document filling a row, the model's heads and head size) forward + backward at
  L, 2L and 4L tokens: seconds per query-key pair; at 16 tokens, the fixed cost of one call
  (``attn_call_s``), added to the floor. That kernel calls SDPA once per document of a packed
  row (`models.attention.kernel_calls`), so the cost model charges the call's fixed cost per
  document (`Calibration.attn_calls_per_document`);
* attention's knots: the same call over one document of every power of two of tokens from 64
  up to the run's longest sample (`knot_lengths`; at most 4,096): SDPA's cost per pair on a
  CPU falls with the length (the demo's layer: 1.6e-7 processor seconds per pair up to 512
  tokens, 1.2e-7 at 1,024, 8.7e-8 at 4,096), which one slope cannot price, so each length is
  priced at its own cost per pair, interpolated between knots (`Calibration.attn_knots`,
  `fit_knots`). The knots above 4L are timed in three rounds of one call (about 4 processor
  seconds more for the demo's layer up to 4,096 tokens).

Two quantities, measured apart because on a shared machine the second moves far more than the first:

* the constants, in processor seconds of the calling thread (`work_clock`: one intra-op
  thread, as a launch's ranks run; the process's time would also count other threads, and
  wall seconds the share of a core the process gets). Per size the least of six windows'
  mean per call (a window 0.1 s and at least two calls, in rounds over the sizes:
  `timed_rounds`): a burst of other work only adds to a window's processor seconds (its
  caches refilled after), so the least window is the one it missed. Each constant is also
  fitted on the first and on the last half of the rounds: their spread (largest /
  smallest - 1: two calibrations seconds apart) is the calibration's stated confidence,
  logged and cached. On a shared machine the processor seconds per call still move with
  the load and the host (`benchmarks/analytic-cpu_cpu_2026-12-07.md`);
* this launch's slowdown: the wall seconds per calibrated processor second of the
  calibration's own windows, or, with constants from the cache, of three more rounds of
  them (`slowdown`, a few seconds at each launch). It holds the share of a core each rank
  gets and what interruptions add to calls small and large, and follows the machine's
  load; a step's price is the constants times it.

N and L shrink for large models so that one call stays well under a second. Memory
constants (bytes per token: the model's, not the device's) and the recompute fractions stay
the packaged calibration's. The smooth max of floor and compute becomes a sum (p = 1: a CPU
has no idle launch time to hide work in).

`cpu_calibration` caches the constants in a JSON file (``cpu-calibration.json`` beside the
profile path: `dcparallel train`'s ``[profile] path``, else its ``out_dir``) keyed by the CPU,
threads, torch version and the model's sizes, timed anew when its knots stop short of the
run's longest sample. Under
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
from dcparallel.models.attention import AttnFeatures, AttnPattern, attention_kernel, default_kernel, kernel_calls
from dcparallel.profile import cpu_links
from dcparallel.runtime import comm
from dcparallel.spec import ClusterSpec, ModelSpec

log = logging.getLogger(__name__)

CAUSAL = AttnPattern("causal")
#: the cache's file name, beside the profile path
CACHE_NAME = "cpu-calibration.json"
#: floating-point operations of one call at the larger timed size (tens of milliseconds on one core)
TIMING_FLOPS = 2e9
#: rounds each size is timed in, and the least wall seconds and calls of one round's window
#: (`timed_rounds`): eight sizes take about 8 x 6 x 0.1 s = 5 s on an idle core
REPEATS, MIN_S, MIN_CALLS = 6, 0.1, 2
#: rounds of the same windows that time a launch's slowdown when the constants come from the cache
PROBE_ROUNDS = 3
#: tokens of the smallest timings, whose time is nearly all the floor
FLOOR_TOKENS = 16
#: the sizes fitted for a slope, in multiples of the smallest (n, 2n, 4n tokens; L, 2L, 4L)
SCALES = (1, 2, 4)
#: attention's knots (`Calibration.attn_knots`): one document of every power of two of tokens
#: from `MIN_KNOT` up to the run's longest sample (at most `MAX_KNOT`, and no call above
#: `KNOT_FLOPS`); those above 4L timed in `KNOT_ROUNDS` rounds of windows of one call or more
#: (a 4,096-token call of the demo's layer takes 0.7 processor seconds)
MIN_KNOT, MAX_KNOT, KNOT_FLOPS, KNOT_ROUNDS = 64, 4096, 2e10, 3


def work_clock():
    """The clock of the work a call does: this thread's processor time when torch computes on
    the calling thread alone (one intra-op thread, as a launch's ranks run), else the
    process's (its other threads work for the call too)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


@dataclasses.dataclass
class Rounds:
    """What `timed_rounds` saw: per function, per round, the work seconds of one call (the
    mean over the round's window: ``per_call``), and over all windows the calls made and the
    wall seconds."""

    per_call: list[list[float]]
    calls: list[int]
    wall_s: float

    def estimate(self) -> list[float]:
        """Per function, the least over rounds."""
        return [min(b) for b in self.per_call]

    def slowdown(self, seconds: list[float]) -> float:
        """Wall seconds of the windows per processor second of their calls priced at ``seconds`` each."""
        return self.wall_s / sum(c * s for c, s in zip(self.calls, seconds, strict=True))


def timed_rounds(
    fns, repeats: int | None = None, min_s: float | None = None, clock=time.perf_counter, work=None, min_calls=None
) -> Rounds:
    """After a warm-up call of each of ``fns``, ``repeats`` rounds of one window per function, a
    window at least ``min_s`` seconds of ``clock`` and `MIN_CALLS` calls, timed on ``work``
    (default `work_clock`): processor seconds, whatever share of a core each window gets. A
    window spans many of the scheduler's time slices; the least window (`Rounds.estimate`)
    drops those a burst of other work fell into, and the rounds give every function the
    same mix of the machine's load. ``repeats``, ``min_s`` and ``min_calls`` default to
    `REPEATS`, `MIN_S` and `MIN_CALLS`."""
    repeats, min_s, min_calls = repeats or REPEATS, MIN_S if min_s is None else min_s, min_calls or MIN_CALLS
    work = work or work_clock()
    for fn in fns:
        fn()  # warm-up
    per_call: list[list[float]] = [[] for _ in fns]
    calls = [0 for _ in fns]
    wall = 0.0
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            made, t0, w0 = 0, clock(), work()
            while made < min_calls or clock() - t0 < min_s:
                fn()
                made += 1
            calls[i] += made
            wall += clock() - t0
            per_call[i].append((work() - w0) / made)
    return Rounds(per_call, calls, wall)


def _line(xs: list[float], ts: list[float]) -> float:
    """The least-squares slope of ``ts`` over ``xs``."""
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    return sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sum((x - mx) ** 2 for x in xs)


def fit(times: list[float], tokens: list[int], lengths: list[int]) -> dict[str, float]:
    """The time constants from one call's seconds (``times``) of the linear work at ``tokens``
    then of attention at ``lengths``, each list the floor's size first: slopes fitted over the
    larger sizes (per token; per query-key pair), the floor the smallest sizes' time less
    their slopes' share (timed where it is nearly the whole time: an intercept extrapolated
    from the larger sizes would carry their noise)."""
    lin, att = times[: len(tokens)], times[len(tokens) :]
    pairs = [x * (x + 1) / 2 for x in lengths]
    per_token = max(_line(tokens[1:], lin[1:]), 0.5 * lin[-1] / tokens[-1])  # a slope noise cannot zero
    per_pair = max(_line(pairs[1:], att[1:]), 0.0)
    call = max(0.0, att[0] - per_pair * pairs[0])
    floor = max(0.0, lin[0] - per_token * tokens[0]) + call
    return {"lin_s_per_token": per_token, "attn_s_per_pair": per_pair, "floor_s": floor, "attn_call_s": call}


#: the time constants, in a calibration's entry
CONSTANTS = ("lin_s_per_token", "attn_s_per_pair", "floor_s", "attn_call_s")


def fit_knots(lengths: list[int], times: list[float], constants: dict) -> list[list[float]]:
    """`Calibration.attn_knots` from one call's seconds of attention over one document of each
    of ``lengths`` tokens: each length's factor on ``constants``' cost per pair, so that the
    call's fixed cost plus its pairs priced at the factor give back the time measured."""
    per_pair, call = constants["attn_s_per_pair"], constants["attn_call_s"]
    return [
        [int(x), max(t - call, 0.0) / (x * (x + 1) / 2) / max(per_pair, 1e-300)]
        for x, t in zip(lengths, times, strict=True)
    ]


def knot_lengths(spec: ModelSpec, longest: int) -> list[int]:
    """The document lengths attention's knots are timed at: powers of two from `MIN_KNOT` up to
    the first not below ``longest`` (at most `MAX_KNOT`; halved while its call's forward and
    backward, about 6 h L^2 floating-point operations, exceeds `KNOT_FLOPS`)."""
    top = min(MAX_KNOT, 2 ** math.ceil(math.log2(max(longest, MIN_KNOT))))
    while top > MIN_KNOT and 6.0 * spec.hidden * top * top > KNOT_FLOPS:
        top //= 2
    return [2**k for k in range(int(math.log2(MIN_KNOT)), int(math.log2(top)) + 1)]


def robust_fit(rounds: Rounds, tokens: list[int], lengths: list[int]) -> dict:
    """`fit` of each size's estimate; each constant's spread between the fits of the first and
    the last half of the rounds (largest / smallest - 1: two calibrations seconds apart, the
    calibration's stated confidence); the sizes and their estimates (what `slowdown` times
    again at each launch)."""
    est = rounds.estimate()
    out = fit(est, tokens, lengths)
    half = len(rounds.per_call[0]) // 2
    halves = [
        fit([min(b[:half]) for b in rounds.per_call], tokens, lengths),
        fit([min(b[half:]) for b in rounds.per_call], tokens, lengths),
    ]
    out["spread"] = {k: max(f[k] for f in halves) / max(min(f[k] for f in halves), 1e-300) - 1 for k in CONSTANTS}
    out["probe"] = {"tokens": tokens, "lengths": lengths, "seconds": est}
    out["slowdown"] = rounds.slowdown(est)  # over the whole calibration, not cached: the load's
    return out


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
    """fn(L) -> a call of forward + backward of the runtime's CPU kernel, causal attention over
    one document of L tokens."""
    heads = spec.num_heads
    d = spec.head_dim or spec.hidden // heads
    g = torch.Generator().manual_seed(1)
    kernel = default_kernel(torch.device("cpu"))

    def fn(length: int):
        q, k, v = (torch.randn(1, length, heads, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))

        def run():
            kernel(q, k, v, CAUSAL, None).sum().backward()

        return run

    return fn


def _timed_fns(spec: ModelSpec):
    """(linear(n), attention(L)): functions that build one call at n tokens, over L tokens."""
    dtype = torch.float32 if spec.bytes_per_value >= 4 else torch.bfloat16
    return _layer_linear(spec, dtype), _attention(spec, dtype)


def measure(spec: ModelSpec, longest: int = MAX_KNOT, **kw) -> dict:
    """This machine's time constants for ``spec``'s layer in processor seconds, their spread
    over the rounds, the sizes with their seconds (``probe``; see the module doc) and
    attention's knots up to ``longest`` tokens (`knot_lengths`, `fit_knots`); ``kw`` go to
    `timed_rounds`."""
    params = spec.attn_params + spec.mlp_params
    n = _tokens(6.0 * params, 4096) // 4  # the largest timing, 4n tokens, about TIMING_FLOPS
    length = _tokens(6.0 * spec.hidden * math.sqrt(TIMING_FLOPS / (6.0 * spec.hidden)), 4096) // 4  # 6 h (4L)^2 flops
    tokens, lengths = [FLOOR_TOKENS] + [s * n for s in SCALES], [FLOOR_TOKENS] + [s * length for s in SCALES]
    knots = knot_lengths(spec, longest)
    short = [x for x in knots if x <= lengths[-1] and x not in lengths]
    long = [x for x in knots if x > lengths[-1]]
    lin, att = _timed_fns(spec)
    rounds = timed_rounds([lin(x) for x in tokens] + [att(x) for x in lengths + short], **kw)
    est, k = rounds.estimate(), len(tokens + lengths)
    seconds = dict(zip(lengths + short, est[len(tokens) :], strict=True))
    out = robust_fit(dataclasses.replace(rounds, per_call=rounds.per_call[:k], calls=rounds.calls[:k]), tokens, lengths)
    out["slowdown"] = rounds.slowdown(est)  # every window's
    if long:
        kw = {**kw, "repeats": min(kw.get("repeats") or KNOT_ROUNDS, KNOT_ROUNDS), "min_calls": 1}
        seconds.update(zip(long, timed_rounds([att(x) for x in long], **kw).estimate(), strict=True))
    out["attn_knots"] = fit_knots(knots, [seconds[x] for x in knots], out)
    return out


def slowdown(spec: ModelSpec, measured: dict, clock=time.perf_counter, work=None) -> float:
    """Wall seconds per calibrated processor second on this launch now: `PROBE_ROUNDS` rounds
    of the calibration's sizes (``measured["probe"]``, a few seconds), their wall seconds
    over their calls priced at the calibrated seconds. It holds both the share of a core each rank
    gets and what other work's interruptions add to calls small and large (a step's ops are
    both); it follows the machine's load, which the processor-second constants do not."""
    probe = measured["probe"]
    lin, att = _timed_fns(spec)
    fns = [lin(int(x)) for x in probe["tokens"]] + [att(int(x)) for x in probe["lengths"]]
    return timed_rounds(fns, repeats=PROBE_ROUNDS, clock=clock, work=work).slowdown(probe["seconds"])


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
        attn_call_s=float(measured["attn_call_s"]),
        attn_calls_per_document=per_document(spec),
        attn_knots=tuple((int(x), float(f)) for x, f in measured.get("attn_knots", ())),
        lin_s_per_token=float(measured["lin_s_per_token"]) * ref_params / params,
        attn_s_per_pair=float(measured["attn_s_per_pair"])
        * (ref.hidden * ref.attn_per_layer)
        / (spec.hidden * spec.attn_per_layer),
        time_err_mean=0.0,
        time_err_max=0.0,
        num_rows=0,
    )  # nothing fitted: timed


def per_document(spec: ModelSpec) -> bool:
    """Whether the kernel the runtime runs ``spec``'s attention with on a CPU calls once per
    document of a packed row (`models.attention.attention_kernel`, `kernel_calls`)."""
    dtype = torch.float32 if spec.bytes_per_value >= 4 else torch.bfloat16
    kind = spec.attention if spec.attention in ("causal", "full") else "spatial"
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    kernel = attention_kernel("cpu", dtype, AttnFeatures(kind), version)
    return kernel_calls(kernel, 2) == 2


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


def cpu_calibration(spec: ModelSpec, cache: str | Path | None, longest: int = MAX_KNOT) -> Calibration:
    """The calibration of ``spec`` on this CPU: its processor-second constants from ``cache``
    (a JSON file) when it holds this machine's and model's with attention's knots up to
    ``longest`` tokens (`knot_lengths`), else timed now on every rank (collective) and saved
    there by rank 0; times this launch's `slowdown` (every rank, their mean) and returns the
    constants in wall seconds. The same on every rank."""
    return launch_calibration(spec, cache, longest)[0]


def launch_calibration(spec: ModelSpec, cache: str | Path | None, longest: int = MAX_KNOT) -> tuple[Calibration, float]:
    """`cpu_calibration` and the launch's slowdown that scaled its constants."""
    key, path = _key(spec), Path(cache) if cache is not None else None
    hit = _load(path).get(key)
    if hit is not None and not (set(CONSTANTS) <= set(hit) and _covers(hit, knot_lengths(spec, longest))):
        hit = None  # an entry of fewer constants or knots (an older or shorter run's): timed anew
    if not all(comm.all_gather_object(hit is not None)):
        t0 = time.perf_counter()
        every = comm.all_gather_object(measure(spec, longest))
        factor = statistics.fmean(m["slowdown"] for m in every)
        hit = {k: statistics.fmean(m[k] for m in every) for k in CONSTANTS}
        hit["attn_knots"] = [
            [k[0][0], statistics.fmean(x[1] for x in k)] for k in zip(*(m["attn_knots"] for m in every), strict=True)
        ]
        hit["spread"] = {k: max(m["spread"][k] for m in every) for k in CONSTANTS}
        hit["probe"] = {
            **every[0]["probe"],
            "seconds": [statistics.fmean(x) for x in zip(*(m["probe"]["seconds"] for m in every), strict=True)],
        }
        if comm.world_rank() == 0:
            log.info(
                "calibrated the analytic cost model on this CPU in %.1f s, in processor seconds: %.3g per token "
                "of linear work (halves of the rounds within %.0f%%), %.3g per attention pair (%.0f%%), "
                "floor %.3g per layer (%.0f%%), of which %.3g per attention call (%.0f%%) (cached in %s)",
                time.perf_counter() - t0,
                *(v for k in CONSTANTS for v in (hit[k], 100 * hit["spread"][k])),
                path,
            )
            _save(path, key, hit)
    else:
        factor = statistics.fmean(comm.all_gather_object(slowdown(spec, hit)))
    hit = comm.all_gather_object(hit)[0]  # rank 0's (every rank's when they all read the same file)
    if comm.world_rank() == 0:
        log.info(
            "this launch runs at %.2f wall seconds per calibrated processor second (load average %.1f)",
            factor,
            os.getloadavg()[0],
        )
    return calibration(spec, {**{k: hit[k] * factor for k in CONSTANTS}, "attn_knots": hit["attn_knots"]}), factor


def _covers(entry: dict, lengths: list[int]) -> bool:
    """Whether a cached ``entry`` holds attention's knots up to the longest of ``lengths``."""
    return bool(entry.get("attn_knots")) and entry["attn_knots"][-1][0] >= lengths[-1]


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
    spec: ModelSpec, cluster: ClusterSpec, device: torch.device, profile_path: str | Path, longest: int = MAX_KNOT
) -> AnalyticCost:
    """``cost = "analytic"``: the packaged calibration on a GPU, this CPU's and this launch's
    links (`cpu_cluster`; both cached beside ``profile_path``) on a CPU unless
    ``DCPARALLEL_CPU_CALIBRATION=0`` asks for the packaged one (plans that do not depend on
    the machine's timings: the tests'). Collective on a CPU. On a CPU the model's
    ``launch_slowdown`` is the launch's (`slowdown`), and the loader keeps its prices current
    with what the steps measure (`data.refine.track_steps`)."""
    on = device.type == "cpu" and os.environ.get("DCPARALLEL_CPU_CALIBRATION", "1") != "0"
    if not on:
        return AnalyticCost(spec, cluster)
    cache = Path(profile_path).with_name(CACHE_NAME)
    cal, factor = launch_calibration(spec, cache, longest)
    cost = AnalyticCost(spec, cpu_cluster(cluster, cache), cal)
    cost.launch_slowdown = factor  # the loader tracks it (`data.refine.track_steps`): the load moves it
    return cost
