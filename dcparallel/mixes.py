"""Realistic mixes built from public training configurations and dataset statistics, beside
those of `scenarios.MIXES` (which takes them in, so `simulate --distribution NAME` knows them):

- `image-buckets`: multi-aspect image buckets as SDXL, Flux and Open-Sora train them, 256² to
  2048² in tens of shapes (`ImageBuckets`);
- `opensora-stage3`: Open-Sora 1.2's stage-3 bucket configuration, its resolution x frames
  grid with its keep probabilities (`BucketConfig`);
- `long-cpt`: long-context continued pretraining with long documents up-sampled (`TextBlend`);
- `sft-chat-long`: chat SFT mixed with long-document SFT (`TextBlend`).

Each generator holds only numbers the sources publish (named at each mix); every draw is
seeded and vectorized, nothing is downloaded. Video sizes are pixels (frames, height, width):
images are one frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcparallel.spec import Size


def _aspect_shape(area: int, aspect: float, multiple: int) -> tuple[int, int]:
    """(height, width) of about ``area`` pixels at width / height = ``aspect``, both rounded to
    ``multiple`` pixels (the latent patch grid the trainers round to)."""
    h = max(multiple, multiple * round((area / aspect) ** 0.5 / multiple))
    w = max(multiple, multiple * round(h * aspect / multiple))
    return h, w


@dataclass(frozen=True)
class ImageBuckets:
    """Images only: a resolution tier (its side² pixels) drawn by `tier_weights`, then an
    aspect ratio (width / height) by `aspect_weights`; the shape is the tier's area at that
    aspect, sides rounded to `multiple` pixels (SDXL's buckets: 64)."""

    kind = "video"
    tiers: tuple[int, ...]
    tier_weights: tuple[float, ...]
    aspects: tuple[float, ...]
    aspect_weights: tuple[float, ...]
    multiple: int = 64

    def _grid(self) -> list[tuple[int, int, int]]:
        """The shape of every (tier, aspect), tier-major (a small tier's aspects may round alike)."""
        return [(1, *_aspect_shape(t * t, a, self.multiple)) for t in self.tiers for a in self.aspects]

    def shapes(self) -> list[tuple[int, int, int]]:
        return sorted(set(self._grid()))

    def draw(self, rng: np.random.Generator, n: int) -> list[Size]:
        shapes = self._grid()
        tw, aw = np.asarray(self.tier_weights, float), np.asarray(self.aspect_weights, float)
        i = rng.choice(len(self.tiers), n, p=tw / tw.sum()) * len(self.aspects) + rng.choice(
            len(self.aspects), n, p=aw / aw.sum()
        )
        return [shapes[j] for j in i]


@dataclass(frozen=True)
class BucketConfig:
    """A trainer's bucket configuration: per resolution (its pixel area) and frame count, the
    probability a sample that reaches the bucket is kept there (Open-Sora's `bucket_config`);
    a sample not kept tries the next smaller frame count, then the next lower resolution (as
    Open-Sora's bucket assignment walks them). Samples arrive at a resolution by
    `resolution_weights`, as images with probability `image_share`, clips with a duration
    (log-normal, `duration_median_s` at `fps`) that caps their frame count; each sample takes
    an aspect of `aspects` by `aspect_weights`."""

    kind = "video"
    #: (name, height, width) of each resolution: its area is height x width
    resolutions: tuple[tuple[str, int, int], ...]
    resolution_weights: tuple[float, ...]
    #: per resolution, (frames, keep probability) of every bucket, frames ascending, 1 first
    buckets: tuple[tuple[tuple[int, float], ...], ...]
    aspects: tuple[float, ...]
    aspect_weights: tuple[float, ...]
    image_share: float
    duration_median_s: float
    duration_sigma: float
    fps: float
    multiple: int = 16

    def _hw(self, r: int, a: int) -> tuple[int, int]:
        _, h, w = self.resolutions[r]
        return _aspect_shape(h * w, self.aspects[a], self.multiple)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every shape a sample can take (a clip's last resort, the smallest clip at the lowest
        resolution, is one of them)."""
        return sorted(
            {
                (f, *self._hw(r, a))
                for r, b in enumerate(self.buckets)
                for f, p in b
                if p > 0
                for a in range(len(self.aspects))
            }
        )

    def draw(self, rng: np.random.Generator, n: int) -> list[Size]:
        rw, aw = np.asarray(self.resolution_weights, float), np.asarray(self.aspect_weights, float)
        res = rng.choice(len(self.resolutions), n, p=rw / rw.sum())
        asp = rng.choice(len(self.aspects), n, p=aw / aw.sum())
        image = rng.random(n) < self.image_share
        # a clip reaches at least the smallest clip bucket (shorter clips are not kept apart)
        frames = np.where(
            image,
            1.0,
            np.maximum(
                self.fps * self.duration_median_s * np.exp(self.duration_sigma * rng.standard_normal(n)),
                min(f for b in self.buckets for f, _ in b if f > 1),
            ),
        )
        out: list[Size] = []
        for j in range(n):
            r, f = self._assign(int(res[j]), float(frames[j]), rng)
            out.append((f, *self._hw(r, int(asp[j]))))
        return out

    def _assign(self, res: int, frames: float, rng: np.random.Generator) -> tuple[int, int]:
        """(resolution, frames) of a sample: its resolution and the lower ones, largest first,
        each from the largest frame count the sample reaches down; the first bucket that keeps
        it (a draw below its probability), else the last tried."""
        last = (res, 1)
        for r in range(res, -1, -1):
            for f, p in reversed(self.buckets[r]):
                if (f > 1) != (frames > 1) or f > frames or p <= 0:
                    continue  # images in the 1-frame buckets, clips in the others they reach
                last = (r, f)
                if rng.random() < p:
                    return last
        return last


@dataclass(frozen=True)
class TextBlend:
    """Document lengths from a blend of log-normal sources: (weight, median tokens, sigma) each,
    every length clipped to [`min_tokens`, `max_tokens`]."""

    kind = "text"
    sources: tuple[tuple[float, float, float], ...]
    max_tokens: int
    min_tokens: int = 16

    def draw(self, rng: np.random.Generator, n: int) -> list[Size]:
        w = np.asarray([s[0] for s in self.sources], float)
        src = rng.choice(len(self.sources), n, p=w / w.sum())
        med = np.asarray([s[1] for s in self.sources], float)[src]
        sig = np.asarray([s[2] for s in self.sources], float)[src]
        x = med * np.exp(sig * rng.standard_normal(n))
        return [int(v) for v in np.clip(np.rint(x), self.min_tokens, self.max_tokens)]


#: width / height of the aspect buckets the image trainers use, landscape to portrait
IMAGE_ASPECTS = (2.0, 16 / 9, 3 / 2, 4 / 3, 1.0, 3 / 4, 2 / 3, 9 / 16, 1 / 2)

#: Open-Sora 1.2's resolutions (`opensora/datasets/aspect.py`): name, height, width of the area
OPENSORA_RESOLUTIONS = (
    ("144p", 144, 256),
    ("256", 256, 256),
    ("240p", 240, 426),
    ("360p", 360, 640),
    ("512", 512, 512),
    ("480p", 480, 853),
    ("720p", 720, 1280),
    ("1024", 1024, 1024),
    ("1080p", 1080, 1920),
    ("2048", 2048, 2048),
)

NEW_MIXES: dict[str, ImageBuckets | BucketConfig | TextBlend] = {
    # 45 image shapes: SDXL's aspect buckets (Podell et al. 2023, appendix: 64-pixel sides,
    # about 1024² pixels, aspects 1:2 to 2:1) at the four tiers multi-resolution trainers use
    # (Flux, SD3 and Open-Sora's image buckets: 256², 512², 1024², and 2048 for the largest);
    # most images at 512-1024 (LAION-Aesthetics' sizes, as SDXL reports its pre-training data),
    # aspects led by 4:3, 3:2 and 1:1 (photographs), portrait less common than landscape
    "image-buckets": ImageBuckets(
        tiers=(256, 512, 1024, 1536, 2048),
        tier_weights=(0.15, 0.35, 0.35, 0.10, 0.05),
        aspects=IMAGE_ASPECTS,
        aspect_weights=(0.04, 0.12, 0.18, 0.22, 0.20, 0.10, 0.08, 0.04, 0.02),
    ),
    # Open-Sora 1.2 stage 3 (hpcaitech/Open-Sora, configs/opensora-v1-2/train/stage3.py): its
    # bucket_config's keep probabilities per resolution and frame count (a pair's first,
    # frame-count entry); resolutions weighted as its training data (most clips 240p-480p,
    # images to 2048), 5 aspects; clips of median 6 s (Panda-70M: 8.5 s mean) at 24 fps
    "opensora-stage3": BucketConfig(
        resolutions=OPENSORA_RESOLUTIONS,
        resolution_weights=(0.10, 0.10, 0.20, 0.20, 0.10, 0.12, 0.08, 0.05, 0.03, 0.02),
        buckets=(
            ((1, 1.0), (51, 1.0), (102, 1.0), (204, 1.0), (408, 1.0)),
            ((1, 1.0), (51, 0.5), (102, 0.5), (204, 0.5), (408, 0.5)),
            ((1, 1.0), (51, 0.5), (102, 0.5), (204, 0.5), (408, 0.5)),
            ((1, 1.0), (51, 0.5), (102, 0.5), (204, 0.5), (408, 0.5)),
            ((1, 1.0), (51, 0.5), (102, 0.5), (204, 0.5), (408, 0.5)),
            ((1, 1.0), (51, 0.5), (102, 0.5), (204, 0.5)),
            ((1, 0.3), (51, 0.2), (102, 0.1)),
            ((1, 0.3), (51, 0.1), (102, 0.1)),
            ((1, 0.1),),
            ((1, 0.05),),
        ),
        aspects=(16 / 9, 4 / 3, 1.0, 3 / 4, 9 / 16),
        aspect_weights=(0.55, 0.15, 0.10, 0.05, 0.15),
        image_share=0.3,
        duration_median_s=6.0,
        duration_sigma=0.8,
        fps=24.0,
    ),
    # long-context continued pretraining: the original pretraining mix (web documents, median
    # about 600 tokens) with long documents up-sampled to about 30% of the documents' tokens
    # per domain (Fu et al. 2024, "Data Engineering for Scaling Language Models to 128K
    # Context"; ProLong, Gao et al. 2024: books and code repositories of 64k-512k)
    "long-cpt": TextBlend(
        sources=((0.97, 600, 1.4), (0.025, 48_000, 0.8), (0.005, 200_000, 0.6)), max_tokens=512 * 1024
    ),
    # chat SFT (Tulu 3 / UltraChat conversations: median about 800 tokens) mixed with
    # long-document SFT (LongAlign-10k: 8k-64k, median about 16k; ChatQA-2's long tasks to 128k)
    "sft-chat-long": TextBlend(
        sources=((0.92, 800, 0.9), (0.07, 16_000, 0.6), (0.01, 80_000, 0.3)), max_tokens=128 * 1024
    ),
}
