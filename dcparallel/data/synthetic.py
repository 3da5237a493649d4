"""Synthetic datasets for demos, examples and tests (nothing is downloaded): token sequences
a small LM learns within an epoch, and video latents of many shapes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def builtin_lengths(num_samples: int = 420, seed: int = 0) -> list[int]:
    """Skewed document lengths: 70% in [32, 256), 24% in [256, 1024), 6% in [1024, 3072],
    log-uniform inside each range."""
    rng = np.random.default_rng([seed, 77])
    ranges = [(32, 256), (256, 1024), (1024, 3072)]
    which = rng.choice(3, size=num_samples, p=[0.70, 0.24, 0.06])
    lo = np.log([ranges[k][0] for k in which])
    hi = np.log([ranges[k][1] for k in which])
    return [int(x) for x in np.exp(rng.uniform(lo, hi))]


class SyntheticText:
    """Sample i: an arithmetic token sequence (start and stride drawn from (seed, i)), of
    `lengths[i]` tokens: real sequences a small LM learns within an epoch."""

    def __init__(self, lengths: Sequence[int], vocab: int = 256, seed: int = 0):
        self.lengths, self.vocab, self.seed = list(lengths), vocab, seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        import torch

        g = np.random.default_rng([self.seed, 5, i])
        a, b = int(g.integers(self.vocab)), int(g.integers(1, 8))
        return (a + torch.arange(self.lengths[i]) * b) % self.vocab


class SyntheticLatents:
    """Sample i: a video latent (channels, frames, height, width) of ``shapes[i]`` — a smooth
    pattern moving over the frames plus noise, so a model can learn it — and ``text_tokens``
    text embeddings of width ``text_dim`` (a stand-in for an encoded caption), as diffusers
    video transformers take them: ``{"latents": ..., "encoder_hidden_states": ...}``."""

    def __init__(
        self, shapes: Sequence[tuple[int, int, int]], channels: int, text_dim: int, text_tokens: int = 8, seed: int = 0
    ):
        self.shapes, self.channels, self.text_dim, self.text_tokens = list(shapes), channels, text_dim, text_tokens
        self.seed = seed

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int) -> dict:
        import torch

        f, h, w = self.shapes[i]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        phase = torch.rand((), generator=g) * 6.28
        t, y, x = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
        wave = torch.sin(0.7 * x + 0.5 * y + 0.9 * t + phase)
        scale = torch.linspace(0.5, 1.0, self.channels)[:, None, None, None]
        latents = wave[None].expand(self.channels, f, h, w) * scale
        latents = latents + 0.1 * torch.randn(self.channels, f, h, w, generator=g)
        text = torch.randn(self.text_tokens, self.text_dim, generator=g)
        return {"latents": latents.contiguous(), "encoder_hidden_states": text}
