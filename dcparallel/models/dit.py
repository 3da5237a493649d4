"""A small video DiT trained with flow matching.

Latents (channels, frames, height, width) are cut into patches (`patchify`, a pure data
transform the loader runs); the model maps noisy patch tokens + their (t, h, w) positions +
the timestep (adaLN conditioning) to the predicted velocity. Attention is either full 3D
over a sample's tokens, or factorized: even layers spatial (within a frame), odd layers
temporal (across frames). Single-device; attention is the function it is given
(`set_attention`); each layer exposes ``attn_block`` and ``mlp_block``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dcparallel.models.attention import AttentionFn, AttnPattern, local_attention


@dataclass(frozen=True, kw_only=True)
class DiTConfig:
    in_channels: int = 4
    """latent channels"""
    patch: tuple[int, int, int] = (1, 2, 2)
    """patch size in latent (frames, height, width)"""
    hidden: int = 64
    num_layers: int = 2
    """blocks; factorized attention alternates spatial (even) and temporal (odd) blocks"""
    num_heads: int = 4
    mlp_ratio: int = 4
    attention: Literal["full", "factorized"] = "full"
    freq_dim: int = 64
    """sinusoidal timestep features fed to the timestep MLP"""

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.attention not in ("full", "factorized"):
            raise ValueError(f"attention must be 'full' or 'factorized'; got {self.attention!r}")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * math.prod(self.patch)

    @staticmethod
    def tiny(**kw) -> DiTConfig:
        return DiTConfig(**kw)

    @staticmethod
    def dit_1b(**kw) -> DiTConfig:
        """~1.1B parameters: hidden 1152, 16 heads, 46 blocks (23 spatial/temporal pairs),
        4 latent channels, 1x2x2 patches."""
        return DiTConfig(
            **{
                "hidden": 1152,
                "num_layers": 46,
                "num_heads": 16,
                "attention": "factorized",
                "freq_dim": 256,
                **kw,
            }
        )


def patchify(latent: Tensor, patch: tuple[int, int, int]) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """(C, T, H, W) -> tokens (N, C*pt*ph*pw), positions (N, 3) as (t, h, w) patch indices,
    and the grid (frames, spatial tokens). Tokens are frame-major: frame 0's patches first."""
    c, t, h, w = latent.shape
    pt, ph, pw = patch
    if t % pt or h % ph or w % pw:
        raise ValueError(f"latent shape {(t, h, w)} is not divisible by the patch {patch}; crop or pad the latent")
    nt, nh, nw = t // pt, h // ph, w // pw
    x = latent.reshape(c, nt, pt, nh, ph, nw, pw).permute(1, 3, 5, 0, 2, 4, 6)
    tokens = x.reshape(nt * nh * nw, c * pt * ph * pw)
    grid = torch.stack(torch.meshgrid(torch.arange(nt), torch.arange(nh), torch.arange(nw), indexing="ij"), -1)
    return tokens, grid.reshape(-1, 3), (nt, nh * nw)


def sincos(x: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal features (..., dim) of a float tensor (...)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=x.device) / half)
    ang = x.float()[..., None] * freqs
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTAttnBlock(nn.Module):
    """adaLN -> self-attention (full, spatial or temporal) -> gate."""

    def __init__(self, cfg: DiTConfig, kind: str):
        super().__init__()
        self.cfg, self.kind = cfg, kind
        self.norm = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.attention: AttentionFn = local_attention

    def forward(self, x: Tensor, c: Tensor, frames: int) -> Tensor:
        b, n, _ = x.shape
        h = self.cfg.num_heads
        shift, scale, gate = self.ada(F.silu(c)).chunk(3, dim=-1)
        q, k, v = self.qkv(modulate(self.norm(x), shift, scale)).view(b, n, 3, h, -1).unbind(2)
        o = self.attention(q, k, v, AttnPattern(self.kind, frames))
        return gate[:, None] * self.out(o.reshape(b, n, -1))


class DiTMLPBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale, gate = self.ada(F.silu(c)).chunk(3, dim=-1)
        return gate[:, None] * self.fc2(F.gelu(self.fc1(modulate(self.norm(x), shift, scale)), approximate="tanh"))


class DiTLayer(nn.Module):
    def __init__(self, cfg: DiTConfig, kind: str):
        super().__init__()
        self.attn_block = DiTAttnBlock(cfg, kind)
        self.mlp_block = DiTMLPBlock(cfg)

    def forward(self, x: Tensor, c: Tensor, frames: int) -> Tensor:
        x = x + self.attn_block(x, c, frames)
        return x + self.mlp_block(x, c)


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden
        self.x_embed = nn.Linear(cfg.patch_dim, d)
        self.t_embed = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))

        def kind(i: int) -> str:
            return "full" if cfg.attention == "full" else ("spatial" if i % 2 == 0 else "temporal")

        self.layers = nn.ModuleList(DiTLayer(cfg, kind(i)) for i in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Linear(d, 2 * d)
        self.final = nn.Linear(d, cfg.patch_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Small random (not zero) adaLN / output weights so that every parameter gets a
        # non-trivial gradient in the parity tests from the first step.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.normal_(m.bias, std=0.02)

    def set_attention(self, fn: AttentionFn) -> None:
        for layer in self.layers:
            layer.attn_block.attention = fn

    def position_embedding(self, positions: Tensor) -> Tensor:
        """Fixed 3-D sinusoids of (t, h, w) patch indices (B, L, 3) -> (B, L, hidden)."""
        d = self.cfg.hidden
        parts = [d // 3 // 2 * 2] * 3
        parts[0] += d - sum(parts)
        return torch.cat([sincos(positions[..., i], parts[i]) for i in range(3)], dim=-1)

    def forward(self, x: Tensor, positions: Tensor, t: Tensor, frames: int = 1) -> Tensor:
        """x (B, L, patch_dim) noisy tokens, positions (B, L, 3), t (B,) in [0, 1] ->
        velocity (B, L, patch_dim). ``frames`` = latent frames of the samples (their token
        grid is frames x spatial); only factorized attention needs it."""
        h = self.x_embed(x) + self.position_embedding(positions).to(x.dtype)
        c = self.t_embed(sincos(t * 1000.0, self.cfg.freq_dim).to(x.dtype))
        for layer in self.layers:
            h = layer(h, c, frames)
        shift, scale = self.final_ada(F.silu(c)).chunk(2, dim=-1)
        return self.final(modulate(self.final_norm(h), shift, scale))


def draw_flow(
    generator: torch.Generator, num_tokens: int, patch_dim: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Flow-matching randomness of one sample from its generator (on ``device``, the
    generator's): timestep t (logit-normal, a 0-d tensor) and noise (num_tokens, patch_dim)
    over the whole sample's tokens."""
    t = torch.sigmoid(torch.randn((), generator=generator, device=device))
    noise = torch.randn(num_tokens, patch_dim, generator=generator, device=device)
    return t, noise


def flow_matching_loss(model: DiT, x0: Tensor, positions: Tensor, t: Tensor, noise: Tensor, frames: int = 1) -> Tensor:
    """Per-token loss (B, L): mean over channels of (v_pred - (noise - x0))^2 at
    x_t = (1 - t) x0 + t noise; t (B,), noise like x0."""
    tb = t.to(x0.dtype)[:, None, None]
    xt = (1 - tb) * x0 + tb * noise
    pred = model(xt, positions, t, frames)
    return (pred.float() - (noise - x0).float()).pow(2).mean(-1)
