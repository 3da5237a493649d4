"""diffusers video transformers with joint video + text attention (HunyuanVideo, CogVideoX 1.0
and 1.5, Mochi), built from tiny configs (never downloaded), their synthetic data and their
single-process reference: the unmodified model, one sample at a time, plain autograd, with
each sample's noise and timestep drawn from `sample_seed` as the adapters' loss draws them."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import torch
from torch import nn

from dcparallel.runtime.engine import sample_seed
from tests.support import Data

os.environ.setdefault("HF_HUB_OFFLINE", "1")

JOINT_KINDS = ("hunyuan", "cogvideox", "cogvideox15", "mochi")
TEXT_TOKENS, TEXT_DIM = 5, 16
#: latent (frames, height, width) per kind: 3, 9, 18 and 8 tokens (odd at SP 2, padded at SP 4)
SHAPES = {
    "hunyuan": [(3, 2, 2), (1, 6, 6), (3, 4, 6), (2, 4, 4)],
    "cogvideox": [(3, 2, 2), (1, 6, 6), (3, 4, 6), (2, 4, 4)],
    "cogvideox15": [(2, 2, 6), (2, 6, 6), (4, 2, 2), (4, 4, 6)],
    "mochi": [(3, 2, 2), (1, 6, 6), (3, 4, 6), (2, 4, 4)],
}  # frames in pairs: 3, 9, 2, 12 tokens
#: a mixed-resolution epoch per kind (several shapes per token count)
MIX = {
    "hunyuan": [(3, 2, 2), (1, 6, 2), (1, 2, 6), (3, 4, 6), (2, 4, 4), (1, 6, 6), (2, 6, 4), (1, 4, 4)],
    "cogvideox": [(3, 2, 2), (1, 6, 2), (1, 2, 6), (3, 4, 6), (2, 4, 4), (1, 6, 6), (2, 6, 4), (1, 4, 4)],
    "mochi": [(3, 2, 2), (1, 6, 2), (1, 2, 6), (3, 4, 6), (2, 4, 4), (1, 6, 6), (2, 6, 4), (1, 4, 4)],
}


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "hunyuan":
        from diffusers import HunyuanVideoTransformer3DModel

        return HunyuanVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=2,
            patch_size_t=1,
            text_embed_dim=TEXT_DIM,
            pooled_projection_dim=8,
            rope_axes_dim=(2, 2, 4),
            guidance_embeds=True,
        ).float()
    if kind in ("cogvideox", "cogvideox15"):
        from diffusers import CogVideoXTransformer3DModel

        # head dim 16: CogVideoX's 3D rotary splits a head into 1/4 time, 3/8 height, 3/8 width
        return CogVideoXTransformer3DModel(
            num_attention_heads=4,
            attention_head_dim=16,
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=TEXT_DIM,
            num_layers=2,
            sample_width=8,
            sample_height=8,
            sample_frames=9,
            patch_size=2,
            patch_size_t=2 if kind == "cogvideox15" else None,
            max_text_seq_length=TEXT_TOKENS,
            use_rotary_positional_embeddings=True,
        ).float()
    if kind == "mochi":
        from diffusers import MochiTransformer3DModel

        return MochiTransformer3DModel(
            patch_size=2,
            num_attention_heads=4,
            attention_head_dim=8,
            num_layers=2,
            pooled_projection_dim=16,
            in_channels=4,
            text_embed_dim=TEXT_DIM,
            time_embed_dim=16,
        ).float()
    raise ValueError(kind)


def make_data(kind: str, num_samples: int, seed: int) -> Data:
    """Latents of mixed shapes and text; HunyuanVideo's text has 0-2 padded (masked) tokens at
    its end, Mochi's 0-2 masked tokens anywhere (diffusers keeps its real tokens by position)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    docs, shape_of, items = {}, {}, {}
    for i in range(num_samples):
        shape = rng.choice(SHAPES[kind])
        docs[i] = torch.randn(4, *shape, generator=g)
        items[i] = {"latents": docs[i], "encoder_hidden_states": torch.randn(TEXT_TOKENS, TEXT_DIM, generator=g)}
        if kind == "hunyuan":
            mask = torch.ones(TEXT_TOKENS, dtype=torch.long)
            mask[TEXT_TOKENS - rng.randint(0, 2) :] = 0
            items[i] |= {
                "encoder_attention_mask": mask,
                "pooled_projections": torch.randn(8, generator=g),
                "guidance": torch.tensor(6.0),
            }
        if kind == "mochi":
            mask = torch.ones(TEXT_TOKENS, dtype=torch.long)
            mask[rng.sample(range(TEXT_TOKENS), rng.randint(0, 2))] = 0
            items[i]["encoder_attention_mask"] = mask
        shape_of[i] = shape
    data = Data(kind, docs, {}, {}, {}, shape_of)
    data.items = items
    return data


def item(data: Data, sid: int) -> dict:
    return data.items[sid]


def _cogvideox_rotary(model: nn.Module, frames: int, height: int, width: int):
    """The rotary tables diffusers' CogVideoX pipeline builds (latent sizes: VAE factor 1)."""
    if not model.config.use_rotary_positional_embeddings:
        return None
    from diffusers import CogVideoXPipeline

    pipe = SimpleNamespace(transformer=model, vae_scale_factor_spatial=1)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(pipe, height, width, frames, torch.device("cpu"))


def _velocity(model: nn.Module, kind: str, xt, t, it: dict):
    if kind == "hunyuan":
        return model(
            xt,
            timestep=(t * 1000)[None],
            encoder_hidden_states=it["encoder_hidden_states"][None],
            encoder_attention_mask=it["encoder_attention_mask"][None],
            pooled_projections=it["pooled_projections"][None],
            guidance=it["guidance"].reshape(1) * 1000.0,
            return_dict=False,
        )[0]
    if kind == "mochi":
        return model(
            xt,
            encoder_hidden_states=it["encoder_hidden_states"][None],
            timestep=(t * 1000)[None],
            encoder_attention_mask=it["encoder_attention_mask"][None],
            return_dict=False,
        )[0]
    _, _, f, h, w = xt.shape
    out = model(
        xt.transpose(1, 2),
        encoder_hidden_states=it["encoder_hidden_states"][None],
        timestep=(t * 1000)[None],
        image_rotary_emb=_cogvideox_rotary(model, f, h, w),
        return_dict=False,
    )[0]
    return out.transpose(1, 2)


def reference(model: nn.Module, data: Data, sample_ids, seed: int = 0, epoch: int = 0):
    """Mean squared velocity error over every latent position of the samples, and its
    gradient, one sample at a time through the unmodified model."""
    model.zero_grad(set_to_none=True)
    losses, count = [], 0
    for sid in sample_ids:
        g = torch.Generator().manual_seed(sample_seed(seed, epoch, sid))
        t = torch.sigmoid(torch.randn((), generator=g))
        x0 = data.docs[sid][None]
        noise = torch.randn(x0.shape[1:], generator=g)[None]
        pred = _velocity(model, data.kind, (1 - t) * x0 + t * noise, t, data.items[sid])
        se = (pred - (noise - x0)).pow(2).mean(1)
        losses.append(se.sum())
        count += se.numel()
    loss = torch.stack(losses).sum() / count
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


class JointVideoSet:
    """A map-style dataset of the adapter's synthetic samples of the given latent shapes."""

    def __init__(self, shapes, model: nn.Module):
        from dcparallel.adapters import find_adapter

        self.shapes = list(shapes)
        self.sample = find_adapter(model, context_tokens=TEXT_TOKENS).sample

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int):
        return self.sample(self.shapes[i], i)
