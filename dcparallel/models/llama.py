"""A small Llama-style causal LM (RMSNorm, rotary with explicit positions, SwiGLU).

Single-device: attention is a function the model is given (`set_attention`); every layer
exposes ``attn_block`` and ``mlp_block`` (each returns the residual update) so the runtime
can recompute either one in backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dcparallel.models.attention import AttentionFn, AttnPattern, local_attention

CAUSAL = AttnPattern("causal")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 256
    """tokens in the vocabulary"""
    hidden: int = 64
    """model width"""
    num_layers: int = 2
    num_heads: int = 4
    """attention heads; the SP degree must divide it"""
    ffn_hidden: int = 176
    """SwiGLU inner width"""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    """share the input embedding with the output head"""

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads or (self.hidden // self.num_heads) % 2:
            raise ValueError(
                f"hidden {self.hidden} must split into {self.num_heads} heads of even size; "
                f"pick hidden = num_heads x an even head dim"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @staticmethod
    def tiny(**kw) -> LlamaConfig:
        return LlamaConfig(**kw)

    @staticmethod
    def small(**kw) -> LlamaConfig:
        """CPU demos: 4 layers, hidden 256, vocab 4096 (logits do not dominate)."""
        return LlamaConfig(
            **{"vocab_size": 4096, "hidden": 256, "num_layers": 4, "num_heads": 4, "ffn_hidden": 688, **kw}
        )

    @staticmethod
    def llama_7b(**kw) -> LlamaConfig:
        return LlamaConfig(
            **{
                "vocab_size": 32000,
                "hidden": 4096,
                "num_layers": 32,
                "num_heads": 32,
                "ffn_hidden": 11008,
                **kw,
            }
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight


def rotary_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (B, L, 1, head_dim) for integer positions (B, L)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.to(torch.float32)[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)[:, :, None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class AttnBlock(nn.Module):
    """norm -> q, k, v -> rotary -> attention -> output projection."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.attention: AttentionFn = local_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, n, _ = x.shape
        h, d = self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, h, d).unbind(2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.attention(q, k, v, CAUSAL)
        return self.out(o.reshape(b, n, h * d))


class MLPBlock(nn.Module):
    """norm -> SwiGLU."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_block = AttnBlock(cfg)
        self.mlp_block = MLPBlock(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn_block(x, cos, sin)
        return x + self.mlp_block(x)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = (
                    std / math.sqrt(2 * self.cfg.num_layers) if name.endswith(("out.weight", "down.weight")) else std
                )
                nn.init.normal_(p, std=scale)

    def set_attention(self, fn: AttentionFn) -> None:
        """Installs the attention function every layer calls (the runtime's Ulysses one)."""
        for layer in self.layers:
            layer.attn_block.attention = fn

    def forward(self, input_ids: Tensor, positions: Tensor | None = None) -> Tensor:
        """input_ids (B, L) -> logits (B, L, vocab). ``positions`` (B, L) are the tokens'
        positions inside their document (global ones when the sequence is sharded);
        default 0..L-1."""
        b, n = input_ids.shape
        if positions is None:
            positions = torch.arange(n, device=input_ids.device).expand(b, n)
        x = self.embed(input_ids)
        cos, sin = rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))
