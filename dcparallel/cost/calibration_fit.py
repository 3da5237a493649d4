"""The analytic cost model's constants (`Calibration`), fitted to the H200 measurements in
`dcparallel/calibration/` (`fit_calibration`): time per token of linear work, per attention
query-key pair and the launch-bound floor (a smooth maximum of the two); the extra time of
recomputing each sub-block; the activation bytes each part keeps. `cost.analytic` scales them to
any model by its FLOPs per token and hidden sizes.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import NamedTuple

import numpy as np

from dcparallel.spec import LLAMA_7B, STATIC_MODES, STDIT_1B, ModelSpec


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Fitted constants of one reference block on one device (per layer, fwd + bwd)."""

    name: str
    ref: ModelSpec
    #: seconds per token of linear work (all per-token weights of the layer)
    lin_s_per_token: float
    #: seconds per query-key pair (all attention sub-blocks of the layer)
    attn_s_per_pair: float
    #: launch-bound floor of a layer (seconds) and the smooth-max exponent
    floor_s: float
    p: float
    #: extra time of recomputing a sub-block, as a fraction of its compute
    phi_attn: float
    phi_mlp: float
    #: activation bytes per token per layer kept for backward, by part
    act_attn: float
    act_mlp: float
    act_rest: float
    act_full: float
    #: activation bytes per sample per layer independent of its length (e.g. cross-attention context)
    act_per_sample: float
    #: transient working memory of the layer in backward, as a multiple of its kept activations:
    #: measured, and the check of the shape-derived transient `AnalyticCost` prices
    #: (`cost.backward_memory.layer_backward_bytes`)
    transient_none: float
    transient_rec: float
    #: fit quality: mean and max |relative error| of time on the rows fitted
    time_err_mean: float
    time_err_max: float
    num_rows: int
    #: fixed seconds of one attention kernel call beyond the floor's one (per attention
    #: sub-block, fwd + bwd), charged for each further document of a packed text micro-batch
    #: when the device's kernel calls once per document (`models.attention.kernel_calls`: the
    #: SDPA loop on a CPU); 0 where one call takes every document (varlen_attn on a GPU)
    attn_call_s: float = 0.0
    attn_calls_per_document: bool = False
    #: (document length, factor) knots: a text document of that many tokens costs its pairs times
    #: `attn_s_per_pair` times the factor (linear in log2 of the length between knots, the end
    #: knots' beyond), where the kernel's cost per pair moves with the length (a CPU's SDPA:
    #: `profile.cpu_calibration`); none: every length at `attn_s_per_pair` (an H200's fit)
    attn_knots: tuple[tuple[int, float], ...] = ()


def _smoothmax(floor: float, compute: float, p: float) -> float:
    return (floor**p + compute**p) ** (1.0 / p)


def _load(name: str) -> list[dict]:
    text = resources.files("dcparallel.calibration").joinpath(name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _attn_share(model: ModelSpec) -> float:
    return model.attn_params / (model.attn_params + model.mlp_params + model.other_params)


def _fit_time(N: np.ndarray, P: np.ndarray, t: np.ndarray) -> tuple[float, float, float, float, np.ndarray]:
    """Least squares (relative) of t = smoothmax_p(floor, a N + b P) over a grid of p, floor."""
    best = None
    for p in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0):
        for floor in np.quantile(t, [0.0, 0.05, 0.1, 0.2]) * np.array([0.7, 0.85, 1.0, 1.0]):
            c = np.clip(t**p - floor**p, 1e-30, None) ** (1 / p)
            w = 1 / t
            coef, *_ = np.linalg.lstsq(np.stack([N, P], 1) * w[:, None], c * w, rcond=None)
            a, b = max(coef[0], 1e-15), max(coef[1], 0.0)
            pred = (floor**p + (a * N + b * P) ** p) ** (1 / p)
            err = np.abs(pred / t - 1)
            if best is None or err.mean() < best[0]:
                best = (err.mean(), p, float(floor), float(a), float(b), err)
    assert best is not None
    return best[1], best[2], best[3], best[4], best[5]


class TimedRow(NamedTuple):
    """One measured run of a reference layer, with or without full recomputation."""

    tokens: int
    #: query-key pairs its attention computes
    pairs: float
    samples: int
    recompute: bool
    seconds: float
    #: activation bytes kept for backward
    saved: float
    #: peak bytes of the run (None: not measured)
    peak: float | None


class SelectiveRow(NamedTuple):
    """One measured run of a reference layer under a recompute mode (`STATIC_MODES`)."""

    tokens: int
    pairs: float
    samples: int
    mode: str
    seconds: float
    saved: float


def _pairs(tokens: int) -> float:
    """Query-key pairs of causal attention over ``tokens``."""
    return tokens * (tokens + 1) / 2


def _llama_rows() -> tuple[ModelSpec, list[TimedRow], list[SelectiveRow]]:
    """LLaMA-7B's layer: single samples of many lengths, micro-batches of several, recompute modes."""
    ref = LLAMA_7B
    layer = [r for r in _load("h200_blocks.jsonl") if r["kind"] == "layer" and r["cfg"] == "llama-7b-block"]
    b2 = _load("h200_blocks_2.jsonl")
    mbs = [r for r in b2 if r["kind"] == "mbs" and r["cfg"] == "llama-7b-block"]
    sel = [r for r in b2 if r["kind"] == "selective" and r["cfg"] == "llama-7b-block"]
    weights = 2 * 2 * _layer_params(ref)
    rows = [
        TimedRow(
            r["L"], _pairs(r["L"]), 1, r["recompute"], r["fwdbwd_s"], r["saved_act_bytes"], r["peak_bytes"] - weights
        )
        for r in layer
    ]
    rows += [
        TimedRow(r["L"] * r["bs"], r["bs"] * _pairs(r["L"]), r["bs"], False, r["fwdbwd_s"], r["saved_act_bytes"], None)
        for r in mbs
    ]
    sel_rows = [SelectiveRow(r["L"], _pairs(r["L"]), 1, r["mode"], r["fwdbwd_s"], r["saved_act_bytes"]) for r in sel]
    return ref, rows, sel_rows


def _stdit_rows() -> tuple[ModelSpec, list[TimedRow], list[SelectiveRow]]:
    """STDiT-1.1B's layer (a spatial + temporal attention pair) on video buckets and recompute modes."""
    ref = STDIT_1B
    st = [r for r in _load("h200_stdit_buckets.jsonl") if r["kind"] == "stdit"]
    sel = [r for r in _load("h200_stdit_selective.jsonl") if r["kind"] == "stdit_selective"]

    def vp(r: dict) -> float:
        t, s = ref.latent_grid(_shape(r))
        return float(t * s * s + s * t * t)

    rows = [
        TimedRow(
            r["tokens"] * r["bs"],
            r["bs"] * vp(r),
            r["bs"],
            r["recompute"],
            r["fwdbwd_s"],
            r["saved_act_bytes"],
            r["peak_bytes"],
        )
        for r in st
    ]
    sel_rows = [SelectiveRow(r["tokens"], vp(r), 1, r["mode"], r["fwdbwd_s"], r["saved_act_bytes"]) for r in sel]
    return ref, rows, sel_rows


#: the reference blocks a calibration is fitted for, and their rows
READERS = {"llama-7b": _llama_rows, "stdit-1.1b": _stdit_rows}


@functools.cache
def fit_calibration(kind: str) -> Calibration:
    """Fits the constants of `kind` ("llama-7b" or "stdit-1.1b") to the calibration rows."""
    if kind not in READERS:
        raise ValueError(f"no calibration named {kind!r}; known: 'llama-7b', 'stdit-1.1b'")
    ref, rows, sel_rows = READERS[kind]()
    base = [r for r in rows if not r.recompute]
    N = np.array([r.tokens for r in base], float)
    P = np.array([r.pairs for r in base], float)
    t = np.array([r.seconds for r in base], float)
    p, floor, a, b, err = _fit_time(N, P, t)
    phi_attn, phi_mlp = _fit_recompute(rows, sel_rows, _attn_share(ref), floor, a, b, p)
    return Calibration(
        name=kind,
        ref=ref,
        lin_s_per_token=a,
        attn_s_per_pair=b,
        floor_s=floor,
        p=p,
        phi_attn=phi_attn,
        phi_mlp=phi_mlp,
        **_fit_memory(rows, sel_rows),
        time_err_mean=float(err.mean()),
        time_err_max=float(err.max()),
        num_rows=len(base),
    )


def _fit_recompute(
    rows: list[TimedRow], sel_rows: list[SelectiveRow], share: float, floor: float, a: float, b: float, p: float
) -> tuple[float, float]:
    """(phi_attn, phi_mlp), fitted jointly: recomputing a sub-block costs phi times its
    compute, smooth-maxed with its share of the floor (recomputation re-launches kernels);
    ``share``: attention's share of the layer's parameters."""

    def sub_blocks(n: float, pairs: float) -> tuple[float, float]:
        attn = _smoothmax(floor * share, n * a * share + pairs * b, p)
        mlp = _smoothmax(floor * (1 - share), n * a * (1 - share), p)
        return attn, mlp

    X, y = [], []
    none_t = {(r.tokens, r.samples): r.seconds for r in sel_rows if r.mode == "none"}
    for r in sel_rows:
        if r.mode == "none":
            continue
        ca, cm = sub_blocks(r.tokens, r.pairs)
        X.append([ca if r.mode in ("attn", "full") else 0.0, cm if r.mode in ("mlp", "full") else 0.0])
        y.append(r.seconds - none_t[(r.tokens, r.samples)])
    for r in rows:  # full-recompute rows of the block tables
        if r.recompute:
            match = [q.seconds for q in rows if not q.recompute and q.tokens == r.tokens and q.samples == r.samples]
            if match:
                X.append(list(sub_blocks(r.tokens, r.pairs)))
                y.append(r.seconds - match[0])
    Xa, ya = np.array(X), np.array(y)
    w = 1 / np.maximum(np.abs(ya), 1e-4)
    phi, *_ = np.linalg.lstsq(Xa * w[:, None], ya * w, rcond=None)
    phi_attn, phi_mlp = (max(float(v), 0.0) for v in phi)
    return phi_attn, phi_mlp


def _fit_memory(rows: list[TimedRow], sel_rows: list[SelectiveRow]) -> dict[str, float]:
    """The memory constants of `Calibration`: activation bytes per token kept by each part
    (from the recompute modes' rows, linear in tokens), per sample independent of length, and
    the transient working memory of backward relative to the kept activations."""

    def per_tok(mode: str) -> float:
        vals = [r.saved / r.tokens for r in sel_rows if r.mode == mode]
        return float(np.median(vals))

    m_none, m_attn, m_mlp, m_full = (per_tok(k) for k in STATIC_MODES)
    act_attn, act_mlp = m_none - m_attn, m_none - m_mlp
    # length-independent part per sample: saved = m_none * tokens + c * samples
    kept = [r for r in rows if not r.recompute]
    c_sample = float(np.median([max(0.0, (r.saved - m_none * r.tokens) / r.samples) for r in kept]))
    # transient: peak - kept, relative to the kept activations of the layer without recompute
    long = [r for r in rows if r.peak is not None and r.tokens >= 4096]
    tr_none = [(r.peak - r.saved) / r.saved for r in long if not r.recompute]
    kept_none = {(r.tokens, r.samples): r.saved for r in kept}
    tr_rec = [
        (r.peak - r.saved) / kept_none[(r.tokens, r.samples)]
        for r in long
        if r.recompute and (r.tokens, r.samples) in kept_none
    ]
    return dict(
        act_attn=act_attn,
        act_mlp=act_mlp,
        act_rest=m_none - act_attn - act_mlp,
        act_full=m_full,
        act_per_sample=c_sample,
        transient_none=float(np.max(tr_none)),
        transient_rec=float(np.max(tr_rec)),
    )


def _layer_params(model: ModelSpec) -> int:
    return model.attn_params + model.mlp_params + model.other_params


def _shape(r: dict) -> tuple[int, int, int]:
    h = {"144p": 144, "240p": 240, "360p": 360, "480p": 480, "720p": 720}[r["res"]]
    w = {144: 256, 240: 426, 360: 640, 480: 853, 720: 1280}[h]
    return int(r["frames"]), h, w
