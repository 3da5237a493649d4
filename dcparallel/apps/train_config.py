"""The TOML config of `dcparallel train`, validated (the run's inputs: `apps.train_inputs`).

Unknown keys, types and ranges are each named with the fix.

Config (every key optional; defaults below)::

    [model]
    pretrained = ""         # a local transformers causal LM, vision-language model (Qwen-VL) or
                            # diffusers transformer directory (save_pretrained); its family is
                            # read from its config.json
    freeze_vision = false   # vision-language model: the vision tower frozen, its projector trained
    family = "reference"    # "reference" (dcparallel's Llama), "transformers" or "diffusers"
    kind = "llama"          # reference family: "llama" (text)
    hidden = 128            # reference family: must be a multiple of num_heads
    num_layers = 4          # >= 1
    num_heads = 4
    ffn_hidden = 352
    vocab_size = 256
    architecture = ""       # transformers: a *ForCausalLM class, e.g. "Qwen3ForCausalLM";
                            # diffusers: "WanTransformer3DModel"
    [model.config]          # transformers / diffusers: the config's / constructor's fields, e.g.
                            # hidden_size = 128, num_attention_heads = 8, num_key_value_heads = 2

    [data]
    path = ""               # real data: .jsonl / .csv / .parquet / a save_to_disk directory
                            # (text, chat) or a latents manifest .csv / .jsonl; "": synthetic
    format = ""             # "text" | "chat" | "latents"; "": text for LMs, chat with images for
                            # a vision-language model, latents for video
    field = ""              # text / chat: the field holding a row's text ("": "text") or its
                            # messages ("": "messages"), e.g. field = "content"
    latents_column = "latents"          # latents manifest: the column naming a clip's latents file
    text_column = "text_embeddings"     # ... and its text-embeddings file
    max_tokens = 0          # longer documents cut there (or bad with truncate = false); 0: no limit
    truncate = true
    eval_fraction = 0.0     # samples held out for the eval loss (0: no eval split)
    skip_bad = false        # bad samples dropped and reported instead of an error
    skip_oversize = false   # samples no layout fits in memory skipped and reported instead of an error
    lengths = "builtin"     # synthetic data: "builtin" or a file: one token count a line
                            # (diffusers: latent "frames height width" a line), or a .npy array
    num_samples = 200       # builtin: how many samples
    text_tokens = 16        # diffusers: caption embedding tokens per synthetic sample

    [train]
    policy = "dcp"          # "dcp", "bucket" or "packed" (the research policies: `dcparallel simulate`)
    tokens_per_step = 8192
    epochs = 1
    max_steps = 0           # 0: no limit
    lr = 0.003
    seed = 0
    memory_mib = 0          # per-rank budget; 0: the device's memory
    out_dir = "runs/train"
    checkpoint_every = 0    # 0: only at the end of the run
    keep_checkpoints = 2    # committed checkpoints kept (the newest first)
    nan_policy = "stop"     # a non-finite step loss: "stop" (error) or "skip" (no update, reported)
    resume_anyway = false   # resume a checkpoint written under another config
    step_timeout_s = 0      # watchdog: a step longer than this dumps every thread and exits (0: off)
    pg_timeout_s = 120      # process-group timeout: a collective waiting longer fails
    warmup_steps = 0        # linear warmup of the lr over these steps
    schedule = "constant"   # after warmup: "cosine" | "linear" (to 0 at the last step) | "constant"
    max_grad_norm = 0.0     # global-norm gradient clipping (0: off; the norm is logged either way)
    weight_decay = 0.0      # AdamW decoupled weight decay on matrices
    eval_every = 0          # eval loss every N steps and at the end (needs eval_fraction > 0)
    export_dir = ""         # the trained model at the end ("": out_dir/final; model.safetensors if not HF)
    dtype = "auto"          # parameters: "auto" (bfloat16 on GPUs, float32 on CPU), "float32", "bfloat16"
    shard_size = 1          # ranks per parameter-shard block (FSDP2): 1, 2, 4, ... or "auto" (smallest that fits)
    ring = false            # SP groups past the head count: Ulysses x ring attention, profiled like the rest

    [log]
    tensorboard = false     # event files in out_dir/tb (needs tensorboard)
    wandb = false           # Weights & Biases (needs wandb), offline unless wandb_mode = "online"
    wandb_project = "dcparallel"
    wandb_mode = "offline"

    [profile]               # how much the profiler measures
    cost = "profiled"       # or "analytic": plan from the analytic cost model, no profiling
    path = ""               # the profile cache; "": out_dir/profile.json (one copy per world size)
    repeats = 3             # timed runs per layout (median)
    max_repeats = 12        # more runs while the median is not known to +-5% (noise), up to this
    min_time_s = 0.2        # short layouts get more runs, until they add up to this
    max_mbs = 16            # micro-batch sizes doubled up to this
    max_tokens = 4096       # ... or up to this many tokens
    budget_s = 300          # wall time, enforced: coarser for large buckets, none past it (0: no budget)
    refine_steps = 0        # the first N steps' micro-batch times correct the cost model (0: off)
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

import tomllib

from dcparallel.apps.train_lora import LoraConfig
from dcparallel.plan.policies import user_policy


def _opt(
    default: Any, *, lo: float | None = None, gt: float | None = None, choices: tuple = (), resume: bool = True
) -> Any:
    """A config field: ``lo`` (>=), ``gt`` (>), ``choices``; ``resume``: a checkpoint written
    with another value is refused (False: the field may change between launches)."""
    return field(default=default, metadata={"lo": lo, "gt": gt, "choices": choices, "resume": resume})


@dataclass(kw_only=True)
class ModelConfig:
    """The model to build (`dcparallel.apps.presets.build_model`): dcparallel's reference LM,
    or a transformers / diffusers class built from ``config`` (never downloaded)."""

    pretrained: str = _opt("")
    family: str = _opt("reference", choices=("reference", "transformers", "diffusers"))
    architecture: str = _opt("")
    config: dict = field(default_factory=dict)
    kind: str = _opt("llama", choices=("llama", "dit"))
    hidden: int = _opt(128, lo=1)
    num_layers: int = _opt(4, lo=1)
    num_heads: int = _opt(4, lo=1)
    ffn_hidden: int = _opt(352, lo=1)
    vocab_size: int = _opt(256, lo=2)
    freeze_vision: bool = _opt(False)

    def is_vlm(self) -> bool:
        """``pretrained`` holds a vision-language model (a ``vision_config``; `apps.train_vlm`)."""
        p = Path(self.pretrained) / "config.json"
        try:
            return bool(self.pretrained) and "vision_config" in json.loads(p.read_text())
        except (OSError, ValueError):
            return False

    def pretrained_family(self) -> str:
        """ "transformers" or "diffusers", read from ``pretrained``'s config.json (``architectures``
        / ``_class_name``); ValueError naming the path when it is not such a model directory."""
        p = Path(self.pretrained)
        what = f"[model] pretrained = {self.pretrained!r}"
        fix = "give a directory written by save_pretrained (a transformers causal LM or a diffusers transformer)"
        if not p.is_dir():
            raise ValueError(f"{what} is not a directory; {fix}")
        if not (p / "config.json").is_file():
            hint = (
                f" ({p} is a diffusers pipeline: give its transformer folder, e.g. {p / 'transformer'})"
                if (p / "model_index.json").exists()
                else ""
            )
            raise ValueError(f"{what} has no config.json, so it is not a model directory{hint}; {fix}")
        try:
            meta = json.loads((p / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{what}: cannot read {p / 'config.json'} ({exc}); {fix}") from None
        if meta.get("_class_name") and meta.get("_diffusers_version"):
            return "diffusers"
        archs = meta.get("architectures") or []
        if any(str(a).endswith("ForCausalLM") for a in archs) or self.is_vlm():
            return "transformers"
        raise ValueError(
            f"{what}: {p / 'config.json'} names neither a transformers *ForCausalLM (architectures = "
            f"{archs}) or vision-language model (vision_config) nor a diffusers class; {fix}"
        )

    def check(self, where: str) -> None:
        if not isinstance(self.config, dict):
            raise ValueError(f"{where}: [model.config] must be a table of the model's config fields")
        if self.pretrained:
            family = self.pretrained_family()
            if self.family not in ("reference", family):
                raise ValueError(
                    f"{where}: [model] family = {self.family!r} but {self.pretrained} holds a {family} "
                    f"model; remove family (it is read from the directory)"
                )
            self.family = family
            if self.architecture or self.config:
                raise ValueError(
                    f"{where}: [model] pretrained = {self.pretrained!r} loads the directory's own "
                    f"config.json; remove architecture / [model.config] (they build a model from scratch)"
                )
            return
        if self.family != "reference":
            if not self.architecture:
                example = "LlamaForCausalLM" if self.family == "transformers" else "WanTransformer3DModel"
                raise ValueError(f'{where}: [model] family = {self.family!r} needs architecture, e.g. "{example}"')
            return
        if self.hidden % self.num_heads:
            raise ValueError(
                f"{where}: [model] hidden = {self.hidden} is not a multiple of num_heads = "
                f"{self.num_heads}; pick num_heads dividing hidden (e.g. {_divisor(self.hidden)})"
            )


@dataclass(kw_only=True)
class DataConfig:
    path: str = _opt("")
    format: str = _opt("", choices=("", "text", "chat", "latents"))
    field: str = _opt("")
    latents_column: str = _opt("latents")
    text_column: str = _opt("text_embeddings")
    max_tokens: int = _opt(0, lo=0)
    truncate: bool = _opt(True)
    eval_fraction: float = _opt(0.0, lo=0)
    skip_bad: bool = _opt(False)
    skip_oversize: bool = _opt(False)
    lengths: str = _opt("builtin")
    num_samples: int = _opt(200, lo=1)
    text_tokens: int = _opt(16, lo=1)

    def check(self, where: str) -> None:
        if not self.lengths:
            raise ValueError(f'{where}: [data] lengths is empty; give "builtin" or a lengths file')
        if self.path and self.lengths != "builtin":
            raise ValueError(
                f"{where}: [data] path = {self.path!r} and lengths = {self.lengths!r}: a real dataset's "
                f"lengths are computed from it; remove lengths"
            )
        if not self.eval_fraction < 0.5:
            raise ValueError(f"{where}: [data] eval_fraction = {self.eval_fraction} holds out too much; use e.g. 0.05")
        if self.format and not self.path:
            raise ValueError(f"{where}: [data] format = {self.format!r} needs path = the dataset file")


@dataclass(kw_only=True)
class TrainConfig:
    #: one of the user policies (`plan.policies.POLICIES`), checked by `check`
    policy: str = _opt("dcp")
    tokens_per_step: int = _opt(8192, lo=1)
    epochs: int = _opt(1, lo=1, resume=False)
    max_steps: int = _opt(0, lo=0, resume=False)
    lr: float = _opt(3e-3, gt=0)
    seed: int = _opt(0, lo=0)
    memory_mib: int = _opt(0, lo=0)
    out_dir: str = _opt("runs/train", resume=False)
    checkpoint_every: int = _opt(0, lo=0, resume=False)
    keep_checkpoints: int = _opt(2, lo=1, resume=False)
    nan_policy: str = _opt("stop", choices=("stop", "skip"))
    resume_anyway: bool = _opt(False, resume=False)
    step_timeout_s: float = _opt(0.0, lo=0, resume=False)
    pg_timeout_s: float = _opt(120.0, gt=0, resume=False)
    warmup_steps: int = _opt(0, lo=0)
    schedule: str = _opt("constant", choices=("constant", "cosine", "linear"))
    max_grad_norm: float = _opt(0.0, lo=0)
    weight_decay: float = _opt(0.0, lo=0)
    eval_every: int = _opt(0, lo=0, resume=False)
    export_dir: str = _opt("", resume=False)
    dtype: str = _opt("auto", choices=("auto", "float32", "bfloat16", "float16"))
    shard_size: int | str = _opt(1, resume=False)
    ring: bool = _opt(False, resume=False)

    def check(self, where: str) -> None:
        user_policy(self.policy, f"{where}: [train] policy", flag=None)
        if not self.out_dir:
            raise ValueError(f"{where}: [train] out_dir is empty; give a folder for metrics and checkpoints")
        if (s := self.shard_size) != "auto" and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f'{where}: [train] shard_size = {s!r} must be a positive integer (1, 2, 4, ...) or "auto"')


@dataclass(kw_only=True)
class LogConfig:
    tensorboard: bool = _opt(False, resume=False)
    wandb: bool = _opt(False, resume=False)
    wandb_project: str = _opt("dcparallel", resume=False)
    wandb_mode: str = _opt("offline", choices=("offline", "online"), resume=False)

    def check(self, where: str) -> None:
        for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if getattr(self, name) and importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"{where}: [log] {name} = true needs the {module} package: pip install {module} "
                    f"(or 'dcparallel[train]'), or set {name} = false"
                )


@dataclass(kw_only=True)
class ProfileConfig:
    cost: str = _opt("profiled", choices=("profiled", "analytic"))
    path: str = _opt("", resume=False)
    repeats: int = _opt(3, lo=1, resume=False)
    max_repeats: int = _opt(12, lo=1, resume=False)
    min_time_s: float = _opt(0.2, lo=0, resume=False)
    max_mbs: int = _opt(16, lo=1, resume=False)
    max_tokens: int = _opt(4096, lo=1, resume=False)
    budget_s: float = _opt(300.0, lo=0, resume=False)
    refine_steps: int = _opt(0, lo=0, resume=False)

    def check(self, where: str) -> None:
        pass

    def profiler_config(self, memory_limit: int, progress: bool) -> Any:
        """The `dcparallel.profile.ProfilerConfig` of these settings."""
        from dcparallel.profile.profiler import ProfilerConfig

        return ProfilerConfig.quick(
            self.max_tokens,
            repeats=self.repeats,
            max_repeats=max(self.repeats, self.max_repeats),
            min_time_s=self.min_time_s,
            max_mbs=self.max_mbs,
            memory_limit=memory_limit,
            progress=progress,
            budget_s=self.budget_s or None,
        )


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "profile": ProfileConfig,
    "log": LogConfig,
    "lora": LoraConfig,
}


def _divisor(n: int) -> int:
    return next(k for k in (8, 4, 2, 1) if n % k == 0)


def _check_value(where: str, section: str, f: dataclasses.Field, kind: type, value: Any) -> Any:
    """``value`` as the field's type, or ValueError naming the key, the value and the fix."""
    key = f"[{section}] {f.name} = {value!r}"
    if kind is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {key} must be a table ([{section}.{f.name}]), not {_tname(value)}")
        return value
    example = f"e.g. {f.name} = {json.dumps(f.default)}"
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false ({example})")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {key} must be an integer, not {_tname(value)} ({example})")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key} must be a number, not {_tname(value)} ({example})")
        if not math.isfinite(value):
            raise ValueError(f"{where}: {key} must be a finite number ({example})")
        value = float(value)
    elif kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: {key} must be a string in quotes, not {_tname(value)} ({example})")
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise ValueError(f"{where}: {key} is not one of {', '.join(map(repr, m['choices']))}")
    if m.get("lo") is not None and value < m["lo"]:
        raise ValueError(f"{where}: {key} must be >= {m['lo']} ({example})")
    if m.get("gt") is not None and not value > m["gt"]:
        raise ValueError(f"{where}: {key} must be > {m['gt']} ({example})")
    return value


def _tname(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", list: "a list", dict: "a table", float: "a fraction"}
    return names.get(type(value), type(value).__name__)


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # `apps.train_lora`

    @staticmethod
    def load(path: str | Path) -> Config:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read the config {p}: {exc}") from exc
        return Config.from_dict(raw, str(p))

    @staticmethod
    def from_dict(raw: dict, where: str = "config") -> Config:
        """A validated config from a dict of sections (as TOML gives it)."""
        unknown = sorted(set(raw) - set(SECTIONS))
        if unknown:
            raise ValueError(f"{where}: unknown section(s) {unknown}; use {', '.join(f'[{s}]' for s in SECTIONS)}")
        out = Config()
        for section, cls in SECTIONS.items():
            values = raw.get(section, {})
            if not isinstance(values, dict):
                raise ValueError(f"{where}: {section} must be a [{section}] table, not {_tname(values)}")
            known = {f.name for f in fields(cls)}
            bad = sorted(set(values) - known)
            if bad:
                hint = "; ".join(f"{b!r}: did you mean {m!r}?" for b in bad if (m := _closest(b, known)))
                raise ValueError(
                    f"{where}: unknown key(s) {bad} in [{section}]; known: {sorted(known)}"
                    + (f" ({hint})" if hint else "")
                )
            setattr(out, section, cls(**values))
        out.validate(where)
        return out

    def validate(self, where: str = "config") -> None:
        """Types and ranges of every field, then the checks across fields."""
        for section, cls in SECTIONS.items():
            obj = getattr(self, section)
            hints = get_type_hints(cls)
            for f in fields(cls):
                setattr(obj, f.name, _check_value(where, section, f, hints[f.name], getattr(obj, f.name)))
            obj.check(where)
        if self.train.eval_every and not self.data.eval_fraction:
            raise ValueError(
                f"{where}: [train] eval_every = {self.train.eval_every} needs an eval split: set [data] "
                f"eval_fraction (e.g. 0.05)"
            )
        if self.data.path and self.model.family == "reference" and not self.model.pretrained:
            raise ValueError(
                f"{where}: [data] path = {self.data.path!r} needs a tokenizer: train a [model] pretrained "
                f'= "dir" (a transformers model directory with its tokenizer)'
            )
        video, fmt = self.model.family == "diffusers", self.data.format
        if video and self.data.field:
            raise ValueError(
                f"{where}: [data] field = {self.data.field!r} names a text field; a latents manifest "
                f"names its files' columns with latents_column and text_column"
            )
        if fmt and (fmt == "latents") != video:
            want = '"latents"' if video else '"text" or "chat"'
            raise ValueError(f"{where}: [data] format = {fmt!r} does not suit a {self.model.family} model; use {want}")
        if self.model.freeze_vision and not self.model.is_vlm():
            raise ValueError(
                f"{where}: [model] freeze_vision = true needs a vision-language model: [model] pretrained "
                f"= a folder whose config has a vision_config; remove freeze_vision"
            )
        if self.model.family == "reference" and self.model.kind != "llama":
            raise ValueError(
                f"{where}: `dcparallel train` trains the text model (kind = 'llama') for now; "
                f"see examples/video_dit.py for video"
            )

    def resume_key(self) -> dict[str, Any]:
        """The settings a checkpoint must have been written under to be resumed."""
        return {
            f"{s}.{f.name}": getattr(getattr(self, s), f.name)
            for s, cls in SECTIONS.items()
            for f in fields(cls)
            if f.metadata.get("resume", True)
        }


def _closest(name: str, known: set[str]) -> str | None:
    m = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return m[0] if m else None
