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
    #: transient working memory of the layer in backward, as a multiple of its kept activations
    transient_none: float
    transient_rec: float
    #: fit quality: mean and max |relative error| of time on the rows fitted
    time_err_mean: float
    time_err_max: float
    num_rows: int


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


@functools.cache
def fit_calibration(kind: str) -> Calibration:
    """Fits the constants of `kind` ("llama-7b" or "stdit-1.1b") to the calibration rows."""
    if kind == "llama-7b":
        ref = LLAMA_7B
        layer = [r for r in _load("h200_blocks.jsonl") if r["kind"] == "layer" and r["cfg"] == "llama-7b-block"]
        b2 = _load("h200_blocks_2.jsonl")
        mbs = [r for r in b2 if r["kind"] == "mbs" and r["cfg"] == "llama-7b-block"]
        sel = [r for r in b2 if r["kind"] == "selective" and r["cfg"] == "llama-7b-block"]
        # (tokens, pairs, samples, bs, recompute, time, saved, peak)
        rows = [
            (
                r["L"],
                r["L"] * (r["L"] + 1) / 2,
                1,
                r["recompute"],
                r["fwdbwd_s"],
                r["saved_act_bytes"],
                r["peak_bytes"] - 2 * 2 * _layer_params(ref),
            )
            for r in layer
        ]
        rows += [
            (
                r["L"] * r["bs"],
                r["bs"] * r["L"] * (r["L"] + 1) / 2,
                r["bs"],
                False,
                r["fwdbwd_s"],
                r["saved_act_bytes"],
                None,
            )
            for r in mbs
        ]
        sel_rows = [(r["L"], r["L"] * (r["L"] + 1) / 2, 1, r["mode"], r["fwdbwd_s"], r["saved_act_bytes"]) for r in sel]
    elif kind == "stdit-1.1b":
        ref = STDIT_1B
        st = [r for r in _load("h200_stdit_buckets.jsonl") if r["kind"] == "stdit"]
        sel = [r for r in _load("h200_stdit_selective.jsonl") if r["kind"] == "stdit_selective"]

        def vp(r: dict) -> float:
            t, s = ref.latent_grid(_shape(r))
            return float(t * s * s + s * t * t)

        rows = [
            (
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
        sel_rows = [(r["tokens"], vp(r), 1, r["mode"], r["fwdbwd_s"], r["saved_act_bytes"]) for r in sel]
    else:
        raise ValueError(f"no calibration named {kind!r}; known: 'llama-7b', 'stdit-1.1b'")

    base = [r for r in rows if not r[3]]
    N = np.array([r[0] for r in base], float)
    P = np.array([r[1] for r in base], float)
    t = np.array([r[4] for r in base], float)
    p, floor, a, b, err = _fit_time(N, P, t)

    # recompute: extra time = phi * the sub-block's compute (smooth-maxed with its share of
    # the floor: recomputation re-launches kernels). Fit phi_attn, phi_mlp jointly.
    share = _attn_share(ref)
    X, y = [], []
    none_t = {(r[0], r[2]): r[4] for r in sel_rows if r[3] == "none"}
    for n, pp, bs, mode, tt, _ in sel_rows:
        if mode == "none":
            continue
        ca = _smoothmax(floor * share, n * a * share + pp * b, p)
        cm = _smoothmax(floor * (1 - share), n * a * (1 - share), p)
        X.append([ca if mode in ("attn", "full") else 0.0, cm if mode in ("mlp", "full") else 0.0])
        y.append(tt - none_t[(n, bs)])
    for n, pp, bs, rec, tt, _, _ in rows:  # full-recompute rows of the block tables
        if rec:
            match = [r[4] for r in base if r[0] == n and r[2] == bs]
            if match:
                ca = _smoothmax(floor * share, n * a * share + pp * b, p)
                cm = _smoothmax(floor * (1 - share), n * a * (1 - share), p)
                X.append([ca, cm])
                y.append(tt - match[0])
    Xa, ya = np.array(X), np.array(y)
    w = 1 / np.maximum(np.abs(ya), 1e-4)
    phi, *_ = np.linalg.lstsq(Xa * w[:, None], ya * w, rcond=None)
    phi_attn, phi_mlp = (max(float(v), 0.0) for v in phi)

    # memory per token: kept activations by part, from the selective rows (linear in tokens)
    def per_tok(mode: str) -> float:
        vals = [r[5] / r[0] for r in sel_rows if r[3] == mode]
        return float(np.median(vals))

    m_none, m_attn, m_mlp, m_full = (per_tok(k) for k in STATIC_MODES)
    act_attn, act_mlp = m_none - m_attn, m_none - m_mlp
    act_rest = m_none - act_attn - act_mlp
    # length-independent part per sample: least squares of saved = m_none*N + c*samples
    kept = [(r[0], r[2], r[5]) for r in rows if not r[3]]
    c_sample = float(np.median([max(0.0, (s - m_none * n) / bs) for n, bs, s in kept]))
    # transient: peak - kept, relative to the kept activations of the layer without recompute
    tr_none = [
        (pk - s) / s
        for n, bs, rec, s, pk in ((r[0], r[2], r[3], r[5], r[6]) for r in rows)
        if pk is not None and not rec and n >= 4096
    ]
    kept_none = {(r[0], r[2]): r[5] for r in rows if not r[3]}
    tr_rec = [
        (pk - s) / kept_none[(n, bs)]
        for n, bs, rec, s, pk in ((r[0], r[2], r[3], r[5], r[6]) for r in rows)
        if pk is not None and rec and n >= 4096 and (n, bs) in kept_none
    ]
    return Calibration(
        name=kind,
        ref=ref,
        lin_s_per_token=a,
        attn_s_per_pair=b,
        floor_s=floor,
        p=p,
        phi_attn=phi_attn,
        phi_mlp=phi_mlp,
        act_attn=act_attn,
        act_mlp=act_mlp,
        act_rest=act_rest,
        act_full=m_full,
        act_per_sample=c_sample,
        transient_none=float(np.max(tr_none)),
        transient_rec=float(np.max(tr_rec)),
        time_err_mean=float(err.mean()),
        time_err_max=float(err.max()),
        num_rows=len(base),
    )


def _layer_params(model: ModelSpec) -> int:
    return model.attn_params + model.mlp_params + model.other_params


def _shape(r: dict) -> tuple[int, int, int]:
    h = {"144p": 144, "240p": 240, "360p": 360, "480p": 480, "720p": 720}[r["res"]]
    w = {144: 256, 240: 426, 360: 640, 480: 853, 720: 1280}[h]
    return int(r["frames"]), h, w
