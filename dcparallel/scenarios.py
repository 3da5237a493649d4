"""The paper-scale scenarios: models, clusters, length distributions, step budgets.

Distributions are Zipf-like over size classes sorted by size: class i of n gets weight
1 / (r_i + 1) ** ALPHA with r_i = i (`short`: the smallest class most common),
r_i = n - 1 - i (`long`), or r_i = |i - (n - 1) / 2| (`balanced`: the middle classes most
common). Video classes are the 25 Open-Sora buckets (144p..720p x 1, 51, 102, 204, 408
frames); text classes are the 11 power-of-two length ranges [64, 128) .. [65536, 131072],
lengths log-uniform inside a range.

The realistic mixes (`MIXES`, `simulate --distribution NAME`) are generated from parameters
written below that follow published statistics of real corpora (named at each one): video
mixes of images beside clips in dozens of (frames, resolution) shapes, text mixes with heavy
tails to 128k and 1M tokens; and those of `mixes.py` (image aspect buckets, a public video
trainer's bucket configuration, long-context continued pretraining, chat beside long-document
SFT). Nothing is downloaded; each is seeded.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from dcparallel.mixes import NEW_MIXES, BucketConfig, ImageBuckets, TextBlend
from dcparallel.spec import LLAMA_7B, STDIT_1B, ClusterSpec, ModelSpec, Size, batch_key, check_size, h200_cluster
from dcparallel.vision_spec import VisionTower

Distribution = Literal["short", "balanced", "long"]
DISTRIBUTIONS: tuple[Distribution, ...] = ("short", "balanced", "long")
ALPHA = 1.2
DEFAULT_SEED = 0

RESOLUTIONS = {"144p": (144, 256), "240p": (240, 426), "360p": (360, 640), "480p": (480, 853), "720p": (720, 1280)}
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


def decoder_lm(
    name: str,
    *,
    num_layers: int,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    ffn_hidden: int,
    vocab_size: int,
    qkv_bias: bool = False,
    tied: bool = False,
    vision: VisionTower | None = None,
) -> ModelSpec:
    """A Llama-family decoder (grouped-query attention, SwiGLU, RMSNorm) with its exact
    parameter counts, as transformers builds it: q, k, v, o projections (q, k, v with biases
    for Qwen2), gate / up / down, two norms per layer; embeddings, head (unless tied), final norm."""
    hd = hidden // num_heads
    bias = (num_heads + 2 * num_kv_heads) * hd if qkv_bias else 0
    attn = 2 * hidden * num_heads * hd + 2 * hidden * num_kv_heads * hd + bias
    return ModelSpec(
        name=name,
        kind="text",
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        ffn_hidden=ffn_hidden,
        attention="causal",
        attn_params=attn,
        mlp_params=3 * hidden * ffn_hidden,
        other_params=2 * hidden,
        extra_params=vocab_size * hidden * (1 if tied else 2) + hidden,
        vocab_size=vocab_size,
        num_kv_heads=num_kv_heads if num_kv_heads != num_heads else 0,
        vision=vision,
    )


#: Published architectures for `dcparallel simulate --model NAME`, parameters counted exactly
#: (tests/unit/test_sharded_plan.py builds each on the meta device and compares). Video sizes
#: are pixels: a 4x temporal / 8x spatial VAE and 1x2x2 patches (16-pixel tokens).
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        decoder_lm(
            "llama-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336, vocab_size=128256
        ),  # Llama 3.1 8B
        decoder_lm(
            "llama-70b", num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8, ffn_hidden=28672, vocab_size=128256
        ),  # Llama 3.1 70B
        decoder_lm(
            "qwen-32b",
            num_layers=64,
            hidden=5120,
            num_heads=40,
            num_kv_heads=8,
            ffn_hidden=27648,
            vocab_size=152064,
            qkv_bias=True,
        ),  # Qwen2.5 32B
        # Qwen2.5-VL 7B: its language model and its 676M vision tower (32 blocks of width 1280,
        # SwiGLU 3420, biases; blocks 7, 15, 23, 31 attend over the whole image, the others in
        # 112-pixel windows = 64 patches; patch embedding 2x14x14 and the 2x2 merger)
        decoder_lm(
            "qwen2.5-vl-7b",
            num_layers=28,
            hidden=3584,
            num_heads=28,
            num_kv_heads=4,
            ffn_hidden=18944,
            vocab_size=152064,
            qkv_bias=True,
            vision=VisionTower(
                num_layers=32, hidden=1280, layer_params=19_702_200, full_layers=4, window=64, extra_params=46_079_744
            ),
        ),
        # Wan 2.1 T2V 14B (diffusers WanTransformer3DModel): per block self- and cross-attention
        # (q, k, v, o with biases, q/k RMS norms), a GELU MLP (13824), a cross-attention norm
        # and the modulation table; counted as the Wan adapter derives it
        ModelSpec(
            name="wan-14b",
            kind="video",
            num_layers=40,
            hidden=5120,
            num_heads=40,
            ffn_hidden=13824,
            attention="full",
            attn_params=209_776_640,
            mlp_params=141_576_704,
            other_params=40_960,
            extra_params=232_719_424,
            context_tokens=512,
            t_num=1,
            t_den=4,
            spatial_patch=16,
        ),
        # HunyuanVideo 13B (diffusers HunyuanVideoTransformer3DModel): 20 dual-stream blocks (video
        # and text tokens through their own weights) + 40 single-stream blocks, all joint full
        # attention; every token meets 12 d^2 weights per block (q, k, v, o and a 4x MLP), so a
        # planner layer is one block of those; the text stream's weights, modulations and
        # embedders are outside the layers; a dual-stream block (339.8M) is gathered whole
        ModelSpec(
            name="hunyuanvideo-13b",
            kind="video",
            num_layers=60,
            hidden=3072,
            num_heads=24,
            ffn_hidden=12288,
            attention="full",
            attn_params=4 * 3072 * 3072 + 4 * 3072,
            mlp_params=8 * 3072 * 3072 + 5 * 3072,
            other_params=2 * 128,
            extra_params=12_821_012_544 - 60 * (12 * 3072 * 3072 + 9 * 3072 + 256),
            max_unit_params=339_831_296,
            context_tokens=256,
            t_num=1,
            t_den=4,
            spatial_patch=16,
        ),
    )
}


def model_preset(name: str) -> ModelSpec:
    """A `MODEL_PRESETS` entry by name (a ValueError lists them)."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; choose one of {sorted(MODEL_PRESETS)}, or give a transformers / "
            f"diffusers config file (--model-config)"
        ) from None


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


def sample_sizes(
    scenario: str,
    distribution: str,
    num_samples: int | None = None,
    seed: int = DEFAULT_SEED,
    epoch_tokens: int | None = None,
) -> list[Size]:
    """`num_samples` samples of the distribution (one of `DISTRIBUTIONS`, or a realistic mix
    of `MIXES` of the scenario's kind); by default as many as make about `epoch_tokens`
    tokens (default: `EPOCH_STEPS` steps of the scenario's `tokens_per_step`; the scale
    benchmark asks for more, so that a large world's larger steps are several).
    Deterministic in `seed`; a larger `epoch_tokens` extends the same sequence."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {sorted(SCENARIOS)}")
    sc = SCENARIOS[scenario]
    total_tokens = EPOCH_STEPS * sc.tokens_per_step if epoch_tokens is None else epoch_tokens
    if distribution in MIXES:
        mix = MIXES[distribution]
        if mix.kind != scenario:
            raise ValueError(
                f"mix {distribution!r} holds {mix.kind} samples, not {scenario}; use it with --scenario {mix.kind}"
            )
        rng = np.random.default_rng([seed, 3, zlib.crc32(distribution.encode())])
    elif distribution in DISTRIBUTIONS:
        rng = np.random.default_rng([seed, 1 if scenario == "video" else 2, DISTRIBUTIONS.index(distribution)])
    else:
        raise ValueError(f"unknown distribution {distribution!r}; choose one of {ALL_DISTRIBUTIONS}")
    out: list[Size] = []
    total = 0
    while (num_samples is None and total < total_tokens) or (num_samples is not None and len(out) < num_samples):
        batch = _draw(scenario, distribution, rng, 256 if num_samples is None else num_samples - len(out))
        for s in batch:
            if num_samples is None and total >= total_tokens:
                break
            out.append(s)
            total += sc.model.tokens(s)
    return out


def _draw(scenario: str, distribution: str, rng: np.random.Generator, n: int) -> list[Size]:
    if distribution in MIXES:
        return MIXES[distribution].draw(rng, n)
    if scenario == "video":
        shapes = video_buckets()
        idx = rng.choice(len(shapes), size=n, p=zipf_weights(len(shapes), distribution))
        return [shapes[i] for i in idx]
    classes = len(TEXT_EDGES) - 1
    idx = rng.choice(classes, size=n, p=zipf_weights(classes, distribution))
    lo = np.log(np.array(TEXT_EDGES[:-1], float)[idx])
    hi = np.log(np.array(TEXT_EDGES[1:], float)[idx])
    return [int(x) for x in np.minimum(np.exp(rng.uniform(lo, hi)), TEXT_EDGES[-1]).astype(int)]


#: width:height ratios of the aspect-ratio buckets video mixes use
ASPECTS = {"16:9": (16, 9), "4:3": (4, 3), "1:1": (1, 1), "3:4": (3, 4), "9:16": (9, 16)}


@dataclass(frozen=True)
class VideoMix:
    """Images beside clips in (frames, height, width) shapes. A sample is an image with
    probability `image_share`; its height and aspect bucket are drawn from the weights
    (images and clips have their own height weights); a clip's duration is log-normal, its
    frame count the largest of `frame_buckets` not above duration x `fps` (the smallest
    bucket for shorter clips), cut further to the largest bucket whose latent tokens stay
    within `max_clip_tokens` (high resolutions get short clips, as in Open-Sora's buckets)."""

    kind = "video"
    heights: tuple[int, ...]
    clip_height_weights: tuple[float, ...]
    image_height_weights: tuple[float, ...]
    aspects: tuple[str, ...]
    aspect_weights: tuple[float, ...]
    frame_buckets: tuple[int, ...]
    image_share: float
    duration_median_s: float
    duration_sigma: float
    fps: float
    max_clip_tokens: int

    def resolutions(self) -> list[tuple[int, int]]:
        """(height, width) of every height x aspect bucket, widths rounded to even pixels;
        the height is the short side (portrait aspects swap it)."""
        out = []
        for h in self.heights:
            for a in self.aspects:
                aw, ah = ASPECTS[a]
                long = 2 * round(h * max(aw, ah) / min(aw, ah) / 2)
                out.append((h, long) if aw >= ah else (long, h))
        return out

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every shape the mix can draw: images at each resolution, clips at each resolution
        and frame bucket within the token cap."""
        na = len(self.aspects)
        res = self.resolutions()
        out = [(1, h, w) for i, (h, w) in enumerate(res) if self.image_height_weights[i // na] > 0]
        for i, (h, w) in enumerate(res):
            if self.clip_height_weights[i // na] > 0:
                out += [(f, h, w) for f in self.frame_buckets[: self._top_bucket(h, w) + 1]]
        return out

    def _top_bucket(self, h: int, w: int) -> int:
        fits = [i for i, f in enumerate(self.frame_buckets) if STDIT_1B.tokens((f, h, w)) <= self.max_clip_tokens]
        return fits[-1] if fits else 0

    def draw(self, rng: np.random.Generator, n: int) -> list[Size]:
        res = self.resolutions()
        na = len(self.aspects)
        image = rng.random(n) < self.image_share
        hw = np.asarray(self.clip_height_weights, float)
        iw = np.asarray(self.image_height_weights, float)
        aw = np.asarray(self.aspect_weights, float)
        height = np.where(
            image, rng.choice(len(self.heights), n, p=iw / iw.sum()), rng.choice(len(self.heights), n, p=hw / hw.sum())
        )
        r = height * na + rng.choice(na, n, p=aw / aw.sum())
        frames_avail = self.fps * self.duration_median_s * np.exp(self.duration_sigma * rng.standard_normal(n))
        b = np.maximum(np.searchsorted(np.asarray(self.frame_buckets, float), frames_avail, side="right") - 1, 0)
        top = np.array([self._top_bucket(h, w) for h, w in res])
        frames = np.where(image, 1, np.asarray(self.frame_buckets)[np.minimum(b, top[r])])
        return [(int(f), *res[i]) for f, i in zip(frames, r)]


@dataclass(frozen=True)
class TextMix:
    """Document lengths: a log-normal body (median `median` tokens) and, with probability
    `tail_share`, a Pareto tail from `tail_min` tokens (index `tail_alpha`) truncated at
    `max_tokens`; every length clipped to [`min_tokens`, `max_tokens`]."""

    kind = "text"
    median: float
    sigma: float
    tail_share: float
    tail_min: int
    tail_alpha: float
    max_tokens: int
    min_tokens: int = 16

    def draw(self, rng: np.random.Generator, n: int) -> list[Size]:
        body = self.median * np.exp(self.sigma * rng.standard_normal(n))
        # inverse CDF of the Pareto truncated at max_tokens: exact, no resampling
        top = 1.0 - (self.tail_min / self.max_tokens) ** self.tail_alpha
        tail = self.tail_min * (1.0 - rng.uniform(0.0, top, n)) ** (-1.0 / self.tail_alpha)
        x = np.where(rng.random(n) < self.tail_share, tail, body)
        return [int(v) for v in np.clip(np.rint(x), self.min_tokens, self.max_tokens)]


MIXES: dict[str, VideoMix | TextMix | ImageBuckets | BucketConfig | TextBlend] = {
    # 64 shapes, 40% images. Resolutions 144p..720p in 16:9, 4:3 and square
    # (Open-Sora 1.2's resolution and aspect-ratio buckets; its bucket configuration keeps
    # fewer clips the higher the resolution, hence the falling clip weights and the token
    # cap); clip durations log-normal with median 6 s (mean about 8 s: Panda-70M reports
    # 8.5 s on average, OpenVid-1M clips mostly 2-15 s) at 24 fps, cut to 16, 51, 102 or
    # 204 frames; 40% images, which image-text corpora hold at higher resolutions.
    "video-mix": VideoMix(
        heights=(144, 240, 360, 480, 720),
        clip_height_weights=(0.30, 0.30, 0.20, 0.12, 0.08),
        image_height_weights=(0.0, 0.20, 0.30, 0.25, 0.25),
        aspects=("16:9", "4:3", "1:1"),
        aspect_weights=(0.60, 0.25, 0.15),
        frame_buckets=(16, 51, 102, 204),
        image_share=0.40,
        duration_median_s=6.0,
        duration_sigma=0.8,
        fps=24.0,
        max_clip_tokens=60_000,
    ),
    # 200 shapes: the same corpora bucketed finely, as a data set trained without a fixed
    # bucket table is: nine heights 144p..720p, portrait aspects too, five frame buckets.
    "video-wide": VideoMix(
        heights=(144, 192, 240, 288, 360, 432, 480, 576, 720),
        clip_height_weights=(0.18, 0.14, 0.16, 0.12, 0.14, 0.08, 0.08, 0.05, 0.05),
        image_height_weights=(0.05, 0.05, 0.10, 0.10, 0.15, 0.10, 0.15, 0.15, 0.15),
        aspects=("16:9", "4:3", "1:1", "3:4", "9:16"),
        aspect_weights=(0.45, 0.20, 0.15, 0.08, 0.12),
        frame_buckets=(16, 51, 102, 136, 204),
        image_share=0.40,
        duration_median_s=6.0,
        duration_sigma=0.8,
        fps=24.0,
        max_clip_tokens=31_000,
    ),
    # long-context SFT: multi-turn chat (ShareGPT / UltraChat: median about 700 tokens) with
    # 15% long-document tasks from 8k to 128k tokens (LongAlign-10k spans 8k-64k; ChatQA-2
    # and LongAlpaca reach 128k)
    "sft-long": TextMix(median=700, sigma=1.0, tail_share=0.15, tail_min=8192, tail_alpha=0.8, max_tokens=128 * 1024),
    # long-context pretraining: web documents (RedPajama / SlimPajama: median about 600
    # tokens, wide log-normal) with 3% books, arXiv papers and code repositories in a heavy
    # tail to 1M tokens (the long-data upsampling of ProLong, Gao et al. 2024)
    "pretrain-long": TextMix(
        median=600, sigma=1.4, tail_share=0.03, tail_min=16384, tail_alpha=0.7, max_tokens=1024 * 1024
    ),
    **NEW_MIXES,
}
#: every name `sample_sizes` (and `simulate --distribution`) takes
ALL_DISTRIBUTIONS: tuple[str, ...] = (*DISTRIBUTIONS, *MIXES)


def distinct_shapes(model: ModelSpec, sizes: list[Size]) -> int:
    """How many classes of samples the planner sees (`spec.batch_key`: video, one latent shape)."""
    return len({batch_key(model, s) for s in sizes})


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
            raise ValueError(
                f"{p}: the lengths array holds {arr.dtype} values, not numbers; save token counts "
                f"(shape (n,)) or frames, height, width (shape (n, 3)) as integers"
            )
        if arr.ndim == 1:
            vals = arr.tolist()
            return [
                _at(p, f"[{i}]", lambda v=v, i=i: check_size(int(v) if float(v).is_integer() else float(v), i))
                for i, v in enumerate(vals)
            ]
        if arr.ndim == 2 and arr.shape[1] == 3:
            return [
                _at(p, f"[{i}]", lambda row=row, i=i: check_size(tuple(float(x) for x in row), i))
                for i, row in enumerate(arr.tolist())
            ]
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
            out.append(
                _at(p, f":{lineno}", lambda v=vals[0]: check_size(v if not v.is_integer() else int(v), len(out)))
            )
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
