"""Library models for the adapter tests, built from configs (never downloaded), and their
single-process references: the unmodified model, one sample at a time, plain autograd."""

from __future__ import annotations

import os
import random

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dcparallel.models.attention import AttnPattern, local_attention
from dcparallel.runtime.engine import sample_seed
from tests import hf_families
from tests.support import Data

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT_KINDS = ("hf-llama", "hf-qwen3", "custom", *hf_families.KINDS)
VOCAB = 96


class TinyGQA(nn.Module):
    """A user's own model, written here as a user would: pre-norm blocks with grouped-query
    attention (4 query heads, 2 key/value heads), learned positions; it follows dcparallel's
    protocol: ``set_attention(fn)``, ``layers``, blocks with ``attn_block`` / ``mlp_block``."""

    class Attn(nn.Module):
        def __init__(self, d: int, heads: int, kv: int):
            super().__init__()
            self.heads, self.kv, self.hd = heads, kv, d // heads
            self.norm = nn.LayerNorm(d)
            self.q = nn.Linear(d, d)
            self.kv_proj = nn.Linear(d, 2 * kv * self.hd)
            self.o = nn.Linear(d, d)
            self.attention = local_attention

        def forward(self, x: Tensor) -> Tensor:
            b, n, _ = x.shape
            h = self.norm(x)
            q = self.q(h).view(b, n, self.heads, self.hd)
            k, v = self.kv_proj(h).view(b, n, 2, self.kv, self.hd).unbind(2)
            return self.o(self.attention(q, k, v, AttnPattern("causal")).reshape(b, n, -1))

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.attn_block = TinyGQA.Attn(d, 4, 2)
            self.mlp_block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

        def forward(self, x: Tensor) -> Tensor:
            x = x + self.attn_block(x)
            return x + self.mlp_block(x)

    def __init__(self, d: int = 32, num_layers: int = 2, max_len: int = 256):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(TinyGQA.Block(d) for _ in range(num_layers))
        self.head = nn.Linear(d, VOCAB)

    def set_attention(self, fn) -> None:
        for b in self.layers:
            b.attn_block.attention = fn

    def forward(self, ids: Tensor, positions: Tensor | None = None) -> Tensor:
        if positions is None:
            positions = torch.arange(ids.shape[1])[None].expand_as(ids)
        x = self.embed(ids) + self.pos(positions)
        for b in self.layers:
            x = b(x)
        return self.head(x)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "hf-llama":  # GQA: 8 query heads, 2 key/value heads: SP 4 repeats each kv head twice
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").float()
    if kind == "hf-qwen3":  # q/k norms per head, 4 query heads, 2 kv heads
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=256,
        )
        return Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").float()
    if kind == "custom":
        return TinyGQA()
    if kind in hf_families.KINDS:
        return hf_families.build(kind, seed)
    if kind in WAN_KINDS:
        from diffusers import WanTransformer3DModel

        extra = {
            "wan-i2v": {"image_dim": 12, "added_kv_proj_dim": 32},  # Wan 2.1 I2V: image embeddings
            "wan22-i2v": {"in_channels": 8},
        }.get(kind, {})  # Wan 2.2 I2V: 4 condition channels
        cfg = dict(
            patch_size=(1, 2, 2),
            num_attention_heads=4,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
        )
        if kind == "skyreels":  # SkyReels-V2 text-to-video with its fps embedding
            from diffusers import SkyReelsV2Transformer3DModel

            return SkyReelsV2Transformer3DModel(**cfg, inject_sample_info=True).float()
        if kind == "skyreels-i2v":  # SkyReels-V2 image-to-video: image embeddings and 4 condition channels
            from diffusers import SkyReelsV2Transformer3DModel

            return SkyReelsV2Transformer3DModel(**{**cfg, "in_channels": 8}, image_dim=12, added_kv_proj_dim=32).float()
        if kind == "helios":  # Helios without history latents (their patch embeddings left out: unused)
            from diffusers import HeliosTransformer3DModel

            c = {k: v for k, v in cfg.items() if k not in ("rope_max_seq_len",)}
            return HeliosTransformer3DModel(**c, rope_dim=(4, 2, 2), has_multi_term_memory_patch=False).float()
        if kind == "vace":  # two control blocks, hints after both of Wan's blocks
            from diffusers import WanVACETransformer3DModel

            return WanVACETransformer3DModel(**cfg, vace_layers=[0, 1], vace_in_channels=6).float()
        if kind == "chronoedit":  # Wan image-to-video with ChronoEdit's rotary tables (2 frames: temporal skip)
            from diffusers import ChronoEditTransformer3DModel

            return ChronoEditTransformer3DModel(
                **cfg, image_dim=12, added_kv_proj_dim=32, rope_temporal_skip_len=4
            ).float()
        return WanTransformer3DModel(**{**cfg, **extra}).float()
    if kind == "ltx":
        from diffusers import LTXVideoTransformer3DModel

        return LTXVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=4,
            attention_head_dim=8,
            cross_attention_dim=32,
            num_layers=2,
            caption_channels=16,
        ).float()
    if kind == "flux":  # one double-stream and two single-stream blocks; 4 latent channels packed 2 x 2
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=16,
            pooled_projection_dim=8,
            guidance_embeds=False,
            axes_dims_rope=(2, 2, 4),
        ).float()
    if kind in ("flux2", "flux2-cond"):  # one double-stream and two single-stream blocks (fused MLP); guidance
        from diffusers import Flux2Transformer2DModel

        # flux2-cond: 4 condition channels after the 4 latent ones (inpainting-style), 4 predicted
        chans = {"in_channels": 32, "out_channels": 16} if kind == "flux2-cond" else {"in_channels": 16}
        return Flux2Transformer2DModel(
            patch_size=1,
            **chans,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=16,
            timestep_guidance_channels=16,
            axes_dims_rope=(2, 2, 2, 2),
            guidance_embeds=True,
        ).float()
    if kind == "qwenimage":  # two dual-stream blocks; 4 latent channels packed 2 x 2 (patch 2 inside)
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=16,
            axes_dims_rope=(2, 2, 4),
        ).float()
    raise ValueError(kind)


#: image transformers: latents (C, H, W), sample sizes (1, H, W), packed 2 x 2
IMAGE_KINDS = ("flux", "flux2", "flux2-cond", "qwenimage")
WAN_KINDS = ("wan", "wan-i2v", "wan22-i2v", "wan-ti2v", "chronoedit", "skyreels", "skyreels-i2v", "vace", "helios")
#: latent (frames, height, width) per kind: token counts odd at SP 2 or 4, several shapes per count
SHAPES = {
    "wan": [(2, 4, 6), (3, 4, 4), (1, 6, 6), (2, 6, 4)],
    "ltx": [(2, 3, 5), (3, 3, 3), (1, 5, 5), (2, 3, 3), (1, 3, 5)],  # patch 1: 30, 27, 25, 18, 15 tokens
    "flux": [(1, 6, 10), (1, 10, 6), (1, 8, 8), (1, 6, 6), (1, 4, 14)],
}  # images: 15, 15, 16, 9, 14 tokens
SHAPES["flux2"] = SHAPES["flux2-cond"] = SHAPES["qwenimage"] = SHAPES["flux"]
WAN_SHAPES = SHAPES["wan"]


def conditioning(kind: str, shape: tuple, g: torch.Generator) -> dict[str, Tensor]:
    """A sample's conditioning as its dataset item carries it."""
    if kind in ("wan", "wan-ti2v", "helios"):
        return {"encoder_hidden_states": torch.randn(5, 16, generator=g)}
    if kind in ("wan-i2v", "chronoedit"):  # diffusers' I2V attention takes the last 512 context tokens as text
        return {
            "encoder_hidden_states": torch.randn(512, 16, generator=g),
            "encoder_hidden_states_image": torch.randn(3, 12, generator=g),
        }
    if kind == "wan22-i2v":
        return {
            "encoder_hidden_states": torch.randn(5, 16, generator=g),
            "condition": torch.randn(4, *shape, generator=g),
        }
    if kind == "skyreels-i2v":
        return {
            "encoder_hidden_states": torch.randn(512, 16, generator=g),
            "encoder_hidden_states_image": torch.randn(3, 12, generator=g),
            "condition": torch.randn(4, *shape, generator=g),
        }
    if kind == "skyreels":  # fps: the row of the fps embedding
        return {"encoder_hidden_states": torch.randn(5, 16, generator=g), "fps": torch.tensor(shape[0] % 2)}
    if kind == "vace":  # control latents (6 channels) of the video's shape
        return {
            "encoder_hidden_states": torch.randn(5, 16, generator=g),
            "control_hidden_states": torch.randn(6, *shape, generator=g),
        }
    if kind == "ltx":  # a text padding mask: the last 2 of 6 tokens are padding
        return {
            "encoder_hidden_states": torch.randn(6, 16, generator=g),
            "encoder_attention_mask": torch.tensor([1, 1, 1, 1, 0, 0]),
        }
    if kind == "flux":
        return {
            "encoder_hidden_states": torch.randn(5, 16, generator=g),
            "pooled_projections": torch.randn(8, generator=g),
        }
    if kind == "flux2":
        return {"encoder_hidden_states": torch.randn(5, 16, generator=g)}
    if kind == "flux2-cond":
        return {
            "encoder_hidden_states": torch.randn(5, 16, generator=g),
            "condition": torch.randn(4, *shape, generator=g),
        }
    if kind == "qwenimage":  # a text mask of any pattern: tokens 2 and 5 are padding
        return {
            "encoder_hidden_states": torch.randn(6, 16, generator=g),
            "encoder_hidden_states_mask": torch.tensor([1, 1, 0, 1, 1, 0]),
        }
    raise ValueError(kind)


def make_data(kind: str, num_samples: int, seed: int) -> Data:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    docs, labels, shape_of, extras = {}, {}, {}, {}
    for i in range(num_samples):
        if kind in TEXT_KINDS:
            n = rng.randint(2, 37)
            docs[i] = torch.randint(0, VOCAB, (n,), generator=g)
            shape_of[i] = (n,)
        else:
            shape = rng.choice(SHAPES["wan" if kind in WAN_KINDS else kind])
            grid = shape[1:] if kind in IMAGE_KINDS else shape
            docs[i] = torch.randn(4, *grid, generator=g)
            extras[i] = conditioning(kind, grid, g)
            shape_of[i] = shape
    data = Data(kind, docs, labels, {}, {}, shape_of)
    data.extras = extras
    return data


def item(data: Data, sid: int):
    """dataset[sid] as the adapter's collate takes it."""
    if data.kind in TEXT_KINDS:
        return data.docs[sid]
    return {"latents": data.docs[sid], **data.extras[sid]}


def ti2v_timesteps(t: Tensor, grid: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    """Wan 2.2 TI2V's per-token timesteps for per-sample t (B,) on a latent grid: the first
    latent frame clean (t = 0, the conditioning image). Returns (per-frame t (B, F) for the
    noising, timesteps (B, N) x 1000 for the model, N = F x H/2 x W/2)."""
    f, h, w = grid
    per_frame = t[:, None].expand(-1, f).clone()
    per_frame[:, 0] = 0.0
    return per_frame, (per_frame[:, :, None] * 1000).expand(-1, f, (h // 2) * (w // 2)).reshape(len(t), -1)


def wan_ti2v_loss(model: nn.Module, batch, ctx) -> Tensor:
    """A user's Wan 2.2 TI2V step: per-token timesteps, flow matching on the noised latents."""
    x0 = batch.inputs
    gens = [ctx.generator(s) for s in batch.sample_ids]  # one per sample: t, then its noise
    t = torch.stack([torch.sigmoid(torch.randn((), generator=g)) for g in gens])
    noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens])
    per_frame, timestep = ti2v_timesteps(t, tuple(x0.shape[2:]))
    tb = per_frame[:, None, :, None, None]
    pred = model(
        (1 - tb) * x0 + tb * noise,
        timestep=timestep,
        encoder_hidden_states=batch.extras["encoder_hidden_states"],
        return_dict=False,
    )[0]
    return ctx.dense_loss((pred - (noise - x0)).pow(2).mean(1))


def predict(model: nn.Module, kind: str, xt: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
    """The unmodified model's prediction for one sample (batch of 1), in the latents' layout,
    called the way each diffusers pipeline calls it."""
    c = {k: v[None] for k, v in cond.items()}
    if kind == "wan-ti2v":  # xt was noised per frame by the caller
        return model(xt, timestep=ti2v_timesteps(t[None], tuple(xt.shape[2:]))[1], return_dict=False, **c)[0]
    if kind in WAN_KINDS:
        if "condition" in c:
            xt = torch.cat([xt, c.pop("condition")], dim=1)
        return model(xt, timestep=(t * 1000)[None], return_dict=False, **c)[0]
    if kind == "ltx":  # patch 1: tokens are the latent positions in (F, H, W) order
        f, h, w = xt.shape[2:]
        tokens = xt.flatten(2).transpose(1, 2)
        out = model(
            tokens,
            timestep=(t * 1000)[None],
            num_frames=f,
            height=h,
            width=w,
            rope_interpolation_scale=(8 / 25, 32, 32),
            return_dict=False,
            **c,
        )[0]
        return out.transpose(1, 2).reshape(xt.shape)
    if kind == "flux":  # 2 x 2 patches packed as diffusers' Flux pipeline packs them
        _, ch, h, w = xt.shape
        packed = xt.view(1, ch, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, -1, ch * 4)
        ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(h // 2.0), torch.arange(w // 2.0), indexing="ij"), -1
        ).reshape(-1, 3)
        out = model(
            packed,
            timestep=t[None],
            img_ids=ids,
            txt_ids=torch.zeros(c["encoder_hidden_states"].shape[1], 3),
            return_dict=False,
            **c,
        )[0]
        return out.view(1, h // 2, w // 2, ch, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(xt.shape)
    if kind in ("flux2", "flux2-cond"):  # Flux 2's pipeline: the same packing, 4-axis ids (t, h, w, l), guidance 4
        h, w = xt.shape[2:]
        ids = torch.cartesian_prod(torch.zeros(1), torch.arange(h // 2.0), torch.arange(w // 2.0), torch.zeros(1))
        num_text = c["encoder_hidden_states"].shape[1]
        txt_ids = torch.cartesian_prod(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.arange(num_text * 1.0))
        return _packed(
            xt,
            c,
            lambda x: model(
                x,
                timestep=t[None],
                img_ids=ids[None],
                txt_ids=txt_ids[None],
                guidance=torch.tensor([4.0]),
                return_dict=False,
                **c,
            )[0],
        )
    if kind == "qwenimage":  # the Qwen-Image pipeline's packing and img_shapes, t in [0, 1]
        h, w = xt.shape[2:]
        return _packed(
            xt, c, lambda x: model(x, timestep=t[None], img_shapes=[[(1, h // 2, w // 2)]], return_dict=False, **c)[0]
        )
    raise ValueError(kind)


def _packed(xt: Tensor, c: dict[str, Tensor], call) -> Tensor:
    """``call`` on the 2 x 2-packed latents (condition channels, if any, appended to the
    channels as the inpainting pipelines concatenate them); its packed output unpacked."""
    _, ch, h, w = xt.shape
    x = torch.cat([xt, c.pop("condition")], dim=1) if "condition" in c else xt
    packed = x.view(1, x.shape[1], h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, -1, x.shape[1] * 4)
    return call(packed).view(1, h // 2, w // 2, ch, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(xt.shape)


def reference(model: nn.Module, data: Data, sample_ids, seed: int = 0, epoch: int = 0):
    """Mean loss over every target of the samples and its gradient, one sample at a time."""
    model.zero_grad(set_to_none=True)
    losses, count = [], 0
    for sid in sample_ids:
        if data.kind in TEXT_KINDS:
            d = data.docs[sid][None]
            logits = model(input_ids=d, use_cache=False).logits if data.kind.startswith("hf") else model(d)
            losses.append(F.cross_entropy(logits[0, :-1].float(), d[0, 1:], reduction="sum"))
            count += d.shape[1] - 1
        else:
            g = torch.Generator().manual_seed(sample_seed(seed, epoch, sid))
            t = torch.sigmoid(torch.randn((), generator=g))
            x0 = data.docs[sid][None]
            noise = torch.randn(x0.shape[1:], generator=g)[None]
            tb = ti2v_timesteps(t[None], x0.shape[2:])[0][:, None, :, None, None] if data.kind == "wan-ti2v" else t
            xt = (1 - tb) * x0 + tb * noise
            pred = predict(model, data.kind, xt, t, data.extras[sid])
            se = (pred - (noise - x0)).pow(2).mean(1)
            losses.append(se.sum())
            count += se.numel()
    loss = torch.stack(losses).sum() / count
    loss.backward()
    # a parameter the loss never reaches (Qwen-Image's last text MLP: the model returns the image only) has gradient 0
    return float(loss.detach()), {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()
    }


#: pixel shapes (frames, height, width) of a real mix: resolutions off the 16-pixel grid and
#: frame counts off Open-Sora's buckets, so one bucket holds several latent shapes
DIT_MIX = [
    (17, 60, 64),
    (17, 64, 64),
    (17, 64, 50),
    (1, 40, 56),
    (1, 48, 48),
    (34, 64, 96),
    (34, 60, 96),
    (20, 48, 64),
    (1, 40, 50),
    (17, 50, 64),
]
#: latent shapes (frames, height, width) for Wan: odd and even sizes, several per token count
WAN_MIX = [(2, 4, 6), (2, 6, 4), (3, 4, 4), (1, 6, 8), (1, 8, 6), (2, 4, 4), (3, 6, 4), (1, 4, 4)]
#: LTX-Video latent shapes (patch 1: one token per position) and Flux latent images (1, H, W):
#: mixed resolutions and aspect ratios, several shapes per token count
MIXES = {
    **dict.fromkeys(("wan", "wan22-i2v", "wan-i2v", "skyreels", "vace", "helios"), WAN_MIX),
    "ltx": [(2, 3, 5), (2, 5, 3), (1, 5, 5), (2, 3, 3), (1, 3, 3), (3, 3, 3), (1, 4, 6), (1, 6, 4)],
    "flux": [(1, 6, 10), (1, 10, 6), (1, 8, 8), (1, 4, 4), (1, 6, 6), (1, 4, 8), (1, 8, 4), (1, 12, 4)],
}
MIXES["flux2"] = MIXES["qwenimage"] = MIXES["flux"]


class VideoSet:
    """A map-style dataset of synthetic videos of the given shapes: reference DiT items
    (patch tokens of the Open-Sora latent grid) or Wan items (latents + text embeddings)."""

    def __init__(self, kind: str, shapes, model: nn.Module):
        from dcparallel.adapters import find_adapter

        self.shapes = list(shapes)
        self.sample = find_adapter(model).sample

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i: int):
        return self.sample(self.shapes[i], i)
