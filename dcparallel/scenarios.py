"""The paper-scale scenarios: models, clusters, length distributions, step budgets.

Distributions are Zipf-like over size classes sorted by size: class i of n gets weight
1 / (r_i + 1) ** ALPHA with r_i = i (`short`: the smallest class most common),
r_i = n - 1 - i (`long`), or r_i = |i - (n - 1) / 2| (`balanced`: the middle classes most
common). Video classes are the 25 Open-Sora buckets (144p..720p x 1, 51, 102, 204, 408
frames); text classes are the 11 power-of-two length ranges [64, 128) .. [65536, 131072],
lengths log-uniform inside a range.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from dcparallel.spec import LLAMA_7B, STDIT_1B, ClusterSpec, ModelSpec, Size, check_size, h200_cluster

Distribution = Literal["short", "balanced", "long"]
DISTRIBUTIONS: tuple[Distribution, ...] = ("short", "balanced", "long")
ALPHA = 1.2
DEFAULT_SEED = 0

RESOLUTIONS = {"144p": (144, 256), "240p": (240, 426), "360p": (360, 640), "480p": (480, 853),
               "720p": (720, 1280)}
FRAMES = (1, 51, 102, 204, 408)
TEXT_EDGES = [64 * 2**i for i in range(12)]  # 64 .. 131072


#: an epoch of a scenario holds about this many steps' worth of tokens
EPOCH_STEPS = 32


@dataclass(frozen=True)
class Scenario:
    name: str
    model: ModelSpec
    tokens_per_step: int

    def cluster(self, world_size: int = 32, gpus_per_node: int = 8) -> ClusterSpec:
        return h200_cluster(world_size, gpus_per_node)


SCENARIOS = {
    # 8M latent tokens a step: ~250k per GPU on 32 GPUs, ~20x the largest sample (432k)
    "video": Scenario("video", STDIT_1B, tokens_per_step=8 * 2**20),
    # 4M tokens a step: ~128k per GPU on 32 GPUs, 32x the longest sample (131072)
    "text": Scenario("text", LLAMA_7B, tokens_per_step=4 * 2**20),
}


def video_buckets() -> list[tuple[int, int, int]]:
    shapes = [(f, h, w) for (h, w) in RESOLUTIONS.values() for f in FRAMES]
    return sorted(shapes, key=lambda s: (STDIT_1B.tokens(s), s))


def zipf_weights(n: int, distribution: Distribution) -> np.ndarray:
    i = np.arange(n, dtype=float)
    if distribution == "short":
        r = i
    elif distribution == "long":
        r = n - 1 - i
    elif distribution == "balanced":
        r = np.abs(i - (n - 1) / 2)
    else:
        raise ValueError(f"unknown distribution {distribution!r}; choose one of {DISTRIBUTIONS}")
    w = 1.0 / (r + 1.0) ** ALPHA
    return w / w.sum()


def sample_sizes(scenario: str, distribution: Distribution, num_samples: int | None = None,
                 seed: int = DEFAULT_SEED, epoch_tokens: int | None = None) -> list[Size]:
    """`num_samples` samples of the distribution; by default as many as make about
    `epoch_tokens` tokens (default: `EPOCH_STEPS` steps of the scenario's `tokens_per_step`;
    the scale benchmark asks for more, so that a large world's larger steps are several).
    Deterministic in `seed`; a larger `epoch_tokens` extends the same sequence."""
    sc = SCENARIOS[scenario]
    total_tokens = EPOCH_STEPS * sc.tokens_per_step if epoch_tokens is None else epoch_tokens
    rng = np.random.default_rng([seed, 1 if scenario == "video" else 2, DISTRIBUTIONS.index(distribution)])
    out: list[Size] = []
    total = 0
    while (num_samples is None and total < total_tokens) or (
            num_samples is not None and len(out) < num_samples):
        batch = _draw(scenario, distribution, rng, 256 if num_samples is None else num_samples - len(out))
        for s in batch:
            if num_samples is None and total >= total_tokens:
                break
            out.append(s)
            total += sc.model.tokens(s)
    return out


def _draw(scenario: str, distribution: Distribution, rng: np.random.Generator, n: int) -> list[Size]:
    if scenario == "video":
        shapes = video_buckets()
        idx = rng.choice(len(shapes), size=n, p=zipf_weights(len(shapes), distribution))
        return [shapes[i] for i in idx]
    classes = len(TEXT_EDGES) - 1
    idx = rng.choice(classes, size=n, p=zipf_weights(classes, distribution))
    lo = np.log(np.array(TEXT_EDGES[:-1], float)[idx])
    hi = np.log(np.array(TEXT_EDGES[1:], float)[idx])
    return [int(x) for x in np.minimum(np.exp(rng.uniform(lo, hi)), TEXT_EDGES[-1]).astype(int)]


def long_token_share(model: ModelSpec, sizes: list[Size], threshold: int = 64 * 1024) -> float:
    """Share of all tokens that sit in samples longer than `threshold` tokens."""
    toks = np.array([model.tokens(s) for s in sizes], float)
    return float(toks[toks > threshold].sum() / toks.sum())


def _at(p: Path, where: str, make):
    """``make()``, with a ValueError prefixed by the file and line (or array index)."""
    try:
        return make()
    except ValueError as exc:
        raise ValueError(f"{p}{where}: {exc}") from None


def read_lengths(path: str | Path) -> list[Size]:
    """A lengths file: one sample a line, `tokens` or `frames height width`; or a `.npy`
    array of shape (n,) or (n, 3). Blank lines and `#` comments are ignored."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"lengths file {p} does not exist")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{p}: not a readable numeric .npy array ({exc}); save one with np.save") from None
        if arr.size == 0:
            raise ValueError(f"{p}: the lengths array is empty (shape {arr.shape}); it needs one size per sample")
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise ValueError(f"{p}: the lengths array holds {arr.dtype} values, not numbers; save token counts "
                             f"(shape (n,)) or frames, height, width (shape (n, 3)) as integers")
        if arr.ndim == 1:
            vals = arr.tolist()
            return [_at(p, f"[{i}]", lambda v=v, i=i: check_size(int(v) if float(v).is_integer() else float(v), i))
                    for i, v in enumerate(vals)]
        if arr.ndim == 2 and arr.shape[1] == 3:
            return [_at(p, f"[{i}]", lambda row=row, i=i: check_size(tuple(float(x) for x in row), i))
                    for i, row in enumerate(arr.tolist())]
        raise ValueError(f"{p}: a lengths array has shape (n,) or (n, 3); got {arr.shape}")
    out: list[Size] = []
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: cannot read the lengths file as text ({exc}); one sample a line") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            vals = [float(x) for x in parts]
        except ValueError:
            raise ValueError(f"{p}:{lineno}: expected integers, got {line!r}") from None
        if len(vals) == 1:
            out.append(_at(p, f":{lineno}", lambda v=vals[0]: check_size(v if not v.is_integer() else int(v),
                                                                        len(out))))
        elif len(vals) == 3:
            out.append(_at(p, f":{lineno}", lambda v=vals: check_size(tuple(v), len(out))))
        else:
            raise ValueError(f"{p}:{lineno}: a line is `tokens` or `frames height width`; got {line!r}")
    if not out:
        raise ValueError(f"lengths file {p} holds no samples (only blank lines or comments); one sample a line")
    kinds = {isinstance(s, tuple) for s in out}
    if len(kinds) > 1:
        raise ValueError(f"{p} mixes text lengths and video shapes; use one kind per file")
    return out
