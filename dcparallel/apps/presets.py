"""The registry of reference models the front-ends build (profile, demo, train), by name.

The profile presets (`dcparallel profile --model NAME`, with default buckets), the demo's
LMs (`LLAMAS`, `llama`), and `train`'s `[model]` (`build_model`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dcparallel.models.dit import DiT, DiTConfig
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.profile.inputs import MakeInputs, reference_inputs, reference_spec
from dcparallel.spec import ModelSpec, Size

#: the reference LMs by name: "tiny-llama" is the demo's (at its --layers depth) and `train`'s default
#: `[model]` shape
LLAMAS: dict[str, LlamaConfig] = {
    "tiny-llama": LlamaConfig(vocab_size=256, hidden=128, num_layers=8, num_heads=4, ffn_hidden=352),
    "small-llama": LlamaConfig.small(num_layers=8),
    "llama-7b": LlamaConfig.llama_7b(),
}


def llama(name: str, seed: int = 0, **overrides) -> Llama:
    """A fresh reference LM `name` of `LLAMAS` (fields overridden, e.g. num_layers=4), on the CPU,
    its weights drawn after ``torch.manual_seed(seed)``."""
    if name not in LLAMAS:
        raise ValueError(f"unknown reference LM {name!r}; choose one of {sorted(LLAMAS)}")
    cfg = dataclasses.replace(LLAMAS[name], **overrides)
    torch.manual_seed(seed)
    return Llama(cfg)


def build_model(m, seed: int) -> nn.Module:
    """The model of `train`'s ``[model]`` section (a `ModelConfig`), on the CPU, seeded: the
    reference LM, or a transformers / diffusers class built from ``[model.config]`` (never
    downloaded)."""
    torch.manual_seed(seed)
    if m.family == "transformers":
        import transformers

        model_cls = getattr(transformers, m.architecture, None)
        config_cls = getattr(transformers, m.architecture.replace("ForCausalLM", "Config"), None)
        if model_cls is None or config_cls is None or not m.architecture.endswith("ForCausalLM"):
            raise ValueError(
                f"[model] architecture = {m.architecture!r} is not a transformers *ForCausalLM class "
                f"with a matching *Config (e.g. LlamaForCausalLM, Qwen3ForCausalLM, MistralForCausalLM)"
            )
        return model_cls._from_config(config_cls(**m.config), attn_implementation="sdpa").float()
    if m.family == "diffusers":
        import diffusers

        model_cls = getattr(diffusers, m.architecture, None)
        if model_cls is None:
            raise ValueError(
                f"[model] architecture = {m.architecture!r} is not a diffusers class (e.g. WanTransformer3DModel)"
            )
        return model_cls(**m.config).float()
    return Llama(
        LlamaConfig(
            vocab_size=m.vocab_size,
            hidden=m.hidden,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            ffn_hidden=m.ffn_hidden,
        )
    )


@dataclass
class Built:
    model: nn.Module
    layers: list[nn.Module]
    spec: ModelSpec
    make_inputs: MakeInputs
    layers_per_unit: int


@dataclass(frozen=True)
class Preset:
    name: str
    build: Callable[[torch.device, torch.dtype, int | None], Built]
    buckets: tuple[Size, ...]
    """default bucket sizes (text: tokens; video: frames x height x width pixels)"""
    help: str


def _reference(name: str, cfg: LlamaConfig | DiTConfig) -> Callable[[torch.device, torch.dtype, int | None], Built]:
    """Builds a reference model of `cfg` (optionally another depth) with its spec and inputs. For
    video, pixels -> latent follow Open-Sora's rule (frames * 5 // 17 latent frames, 16-pixel
    tokens: a 4x temporal / 8x spatial VAE, then the model's 1x2x2 patches)."""

    def build(device: torch.device, dtype: torch.dtype, num_layers: int | None) -> Built:
        c = cfg if num_layers is None else type(cfg)(**{**cfg.__dict__, "num_layers": num_layers})
        if isinstance(c, DiTConfig) and c.attention == "factorized" and c.num_layers % 2:
            raise ValueError(f"a factorized DiT has spatial + temporal pairs: num_layers {c.num_layers} must be even")
        torch.manual_seed(0)
        with torch.device(device):
            model = (Llama if isinstance(c, LlamaConfig) else DiT)(c)
        model = model.to(dtype)
        layers = list(model.layers)
        spec, unit = reference_spec(model, layers, name=name)
        return Built(model, layers, spec, reference_inputs(model, spec, device), unit)

    return build


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny-llama",
            _reference("tiny-llama", LLAMAS["tiny-llama"]),
            (256, 512, 1024, 2048),
            "8 layers, hidden 128, vocab 256 (CPU)",
        ),
        Preset(
            "small-llama",
            _reference("small-llama", LLAMAS["small-llama"]),
            (512, 1024, 2048, 4096),
            "8 layers, hidden 256, vocab 4096 (CPU demos)",
        ),
        Preset(
            "tiny-dit",
            _reference(
                "tiny-dit", DiTConfig(hidden=64, num_layers=8, num_heads=4, freq_dim=32, attention="factorized")
            ),
            ((1, 128, 128), (17, 128, 128), (51, 128, 128), (51, 256, 256)),
            "4 spatial+temporal pairs, hidden 64 (CPU)",
        ),
        Preset(
            "llama-7b",
            _reference("llama-7b", LLAMAS["llama-7b"]),
            (1024, 2048, 4096, 8192, 16384, 32768),
            "Llama-7B dimensions, 32 layers (GPU)",
        ),
        Preset(
            "dit-1b",
            _reference("dit-1b", DiTConfig.dit_1b()),
            ((1, 240, 426), (51, 240, 426), (51, 480, 853), (102, 720, 1280)),
            "~1.1B video DiT, 23 pairs (GPU)",
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(PRESETS)}") from None


def parse_buckets(text: str) -> list[Size]:
    """``"256,1024"`` (tokens) or ``"51x240x426,1x144x256"`` (frames x height x width)."""
    out: list[Size] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "x" in part:
                dims = tuple(int(v) for v in part.split("x"))
                if len(dims) != 3:
                    raise ValueError
                out.append(dims)  # type: ignore[arg-type]
            else:
                out.append(int(part))
        except ValueError:
            raise ValueError(
                f"bad bucket {part!r} in --buckets {text!r}; give token counts (1024) or "
                f"frames x height x width (51x240x426), comma-separated"
            ) from None
    if not out:
        raise ValueError(f"--buckets {text!r} names no bucket")
    return out
