"""What `dcparallel train` builds before its loop and writes after it: the model (a local
pretrained directory or one built from the config) and its tokenizer, the datasets (real or
synthetic, with the eval split), the learning-rate schedule, and where the export goes.

Pretrained models load with ``from_pretrained(dir, local_files_only=True)``: nothing is
downloaded. With a fixed shard_size > 1 they are built on the meta device instead and their
weights read shard by shard after wrapping (`builds_on_meta`). Real datasets are read on
rank 0 first (it computes and caches the lengths; a bad-data error is raised on every rank),
then on the others from the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dcparallel.apps.presets import build_model
from dcparallel.apps.train_config import Config
from dcparallel.runtime import comm
from dcparallel.runtime.meta_init import empty_init


def param_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """[train] dtype: "auto" is bfloat16 on GPUs (the optimizer keeps fp32 master weights)
    and float32 on CPU."""
    if cfg.train.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.train.dtype)


def builds_on_meta(cfg: Config) -> bool:
    """A pretrained model trained with a fixed shard_size > 1 is built on the meta device and
    loaded shard by shard after wrapping (`runtime.meta_init`): no rank holds it whole.
    shard_size "auto" decides from the model's size only when it is wrapped, so it loads whole."""
    s = cfg.train.shard_size
    return bool(cfg.model.pretrained) and isinstance(s, int) and s > 1


def load_model(cfg: Config, device: torch.device) -> tuple[nn.Module, Any]:
    """The model on ``device`` in the run's dtype (on the meta device, without its weights,
    when `builds_on_meta`: the trainer loads them after wrapping), and the tokenizer of a
    pretrained transformers directory (else None)."""
    m = cfg.model
    if not m.pretrained:
        return build_model(m, cfg.train.seed).to(device), None
    dtype = param_dtype(cfg, device)
    meta = builds_on_meta(cfg)
    if m.family == "transformers":
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(m.pretrained, local_files_only=True)
        if meta:
            config = AutoConfig.from_pretrained(m.pretrained, local_files_only=True)
            with empty_init():
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
            keep = set(model._keep_in_fp32_modules_strict or ()) if dtype != torch.float32 else set()
            if dtype == torch.float16:
                keep |= set(model._keep_in_fp32_modules or ())
            return _one_dtype(model, keep, dtype, m.pretrained), tokenizer
        model = AutoModelForCausalLM.from_pretrained(m.pretrained, local_files_only=True, dtype=dtype,
                                                     attn_implementation="sdpa")
        return model.to(device), tokenizer
    import importlib.util
    import json

    import diffusers

    if importlib.util.find_spec("accelerate") is None:  # diffusers' from_pretrained needs it for Wan and others
        raise ValueError(f"loading the diffusers model {m.pretrained} needs accelerate: pip install accelerate "
                         f"(or 'dcparallel[train]')")
    name = json.loads((Path(m.pretrained) / "config.json").read_text())["_class_name"]
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ValueError(f"[model] pretrained = {m.pretrained!r} holds a {name}, which this diffusers does not have")
    if meta:
        with empty_init():
            model = cls.from_config(cls.load_config(m.pretrained, local_files_only=True)).to(dtype)
        keep = set(model._keep_in_fp32_modules or ()) if dtype != torch.float32 else set()
        return _one_dtype(model, keep, dtype, m.pretrained), None
    return cls.from_pretrained(m.pretrained, local_files_only=True, torch_dtype=dtype).to(device), None


def _one_dtype(model: nn.Module, keep_fp32: set[str], dtype: torch.dtype, where: str) -> nn.Module:
    """``model``, unless its class keeps modules in fp32 at ``dtype`` (from_pretrained would
    load them so, and the engine trains one dtype): ValueError naming them."""
    if keep_fp32:
        raise ValueError(f"[model] pretrained = {where!r}: {type(model).__name__} keeps {sorted(keep_fp32)} in float32 "
                         f"when loaded in {dtype}, and the runtime trains one dtype; set [train] dtype = \"float32\"")
    return model


@dataclass
class Data:
    """The training and eval datasets with their sizes (the eval split may be empty)."""

    train: Any
    train_sizes: list
    eval: Any | None
    eval_sizes: list
    context_tokens: int | None = None  # video: text embedding tokens per clip (the cost model's)


class Subset:
    """The samples ``ids`` of ``dataset``, renumbered 0..len-1."""

    def __init__(self, dataset: Any, ids: list[int]):
        self.dataset, self.ids = dataset, list(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.ids[i]]


def _read_real(cfg: Config, model: nn.Module, tokenizer: Any) -> tuple[Any, list, int | None]:
    d = cfg.data
    if cfg.model.family == "diffusers":
        from dcparallel.data.latents_data import latents_dataset

        c = model.config
        ds, sizes = latents_dataset(d.path, channels=c.in_channels, text_dim=c.text_dim, skip_bad=d.skip_bad)
        if len(set(ds.text_tokens)) > 1:  # the adapter stacks a micro-batch's text embeddings
            first = {n: ds.where(i) for i, n in reversed(list(enumerate(ds.text_tokens)))}
            raise ValueError(f"{d.path}: the clips' text embeddings have different lengths ("
                             f"{', '.join(f'{n} tokens at {w}' for n, w in sorted(first.items()))}); pad them to one "
                             f"length when encoding (Wan pads to 512 tokens)")
        return ds, sizes, ds.text_tokens[0]
    from dcparallel.data.text_data import text_dataset

    if tokenizer is None:
        raise ValueError(f"[data] path = {d.path!r} needs a tokenizer: [model] pretrained must name a directory "
                         f"holding one (save it there with tokenizer.save_pretrained)")
    ds, lengths = text_dataset(d.path, tokenizer, format=d.format or "text", max_tokens=d.max_tokens or None,
                               truncate=d.truncate, skip_bad=d.skip_bad)
    return ds, lengths, None


def read_data(cfg: Config, model: nn.Module, tokenizer: Any, synthetic_sizes: list) -> Data:
    """The run's datasets: [data] path read (rank 0 first, then the others from its cache),
    or the synthetic data of ``synthetic_sizes``; ``eval_fraction`` of the samples (drawn
    with the run's seed) held out."""
    d = cfg.data
    if not d.path:
        ds, sizes, tokens = _synthetic(cfg, model, synthetic_sizes), list(synthetic_sizes), None
    else:
        error = None
        if comm.world_rank() == 0:
            try:
                ds, sizes, tokens = _read_real(cfg, model, tokenizer)
            except ValueError as exc:
                error = str(exc)
        error = comm.all_gather_object(error)[0]
        if error is not None:
            raise ValueError(error)
        if comm.world_rank() != 0:
            ds, sizes, tokens = _read_real(cfg, model, tokenizer)
    if not d.eval_fraction:
        return Data(ds, sizes, None, [], tokens)
    n = len(sizes)
    num_eval = max(1, round(d.eval_fraction * n))
    if num_eval >= n:
        raise ValueError(f"[data] eval_fraction = {d.eval_fraction} of {n} samples leaves none to train on")
    held = set(np.random.default_rng([cfg.train.seed, 11]).permutation(n)[:num_eval].tolist())
    train_ids = [i for i in range(n) if i not in held]
    eval_ids = sorted(held)
    return Data(Subset(ds, train_ids), [sizes[i] for i in train_ids], Subset(ds, eval_ids),
                [sizes[i] for i in eval_ids], tokens)


def _synthetic(cfg: Config, model: nn.Module, sizes: list) -> Any:
    from dcparallel.data.synthetic import SyntheticLatents, SyntheticText

    if cfg.model.family == "diffusers":
        c = model.config
        return SyntheticLatents(sizes, channels=c.in_channels, text_dim=c.text_dim,
                                text_tokens=cfg.data.text_tokens, seed=cfg.train.seed)
    vocab = model.config.vocab_size if cfg.model.family == "transformers" else cfg.model.vocab_size
    return SyntheticText(sizes, vocab=vocab, seed=cfg.train.seed)


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str) -> Callable[[int], float]:
    """The lr factor of optimizer step ``s`` (0-based, torch's LambdaLR convention): linear
    warmup (s + 1) / warmup_steps, then "constant" 1, or "cosine" / "linear" decay from 1 at
    step ``warmup_steps`` towards 0 at step ``total_steps`` (one past the last)."""
    decay_steps = max(1, total_steps - warmup_steps)

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / decay_steps)
        return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress

    return factor


def export_path(cfg: Config, out: Path) -> Path:
    """Where the trained model is exported: ``export_dir``, default ``out_dir/final``."""
    return Path(cfg.train.export_dir) if cfg.train.export_dir else out / "final"
