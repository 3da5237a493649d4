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
from dcparallel.apps.train_lora import apply_lora
from dcparallel.runtime import comm
from dcparallel.runtime.meta_init import empty_init


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


#: DataLoader worker processes per rank on GPUs (at most; fewer when the node has fewer cores)
GPU_LOADER_WORKERS = 4


def loader_workers(device: torch.device, local_world_size: int = 1) -> dict:
    """`DataCentricLoader` arguments of `dcparallel train`: on GPUs, workers that read and
    collate while the GPU computes, started by spawn (set process-wide: the training process
    already runs CUDA's and NCCL's threads, and a fork of a threaded process can deadlock in
    the child); on CPU none (the ranks use the cores)."""
    if not on_gpu(device):
        return {}
    import multiprocessing
    import os

    if multiprocessing.get_start_method(allow_none=True) != "spawn":
        multiprocessing.set_start_method("spawn", force=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"num_workers": max(1, min(GPU_LOADER_WORKERS, cores // max(1, local_world_size) - 1))}


def param_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """[train] dtype: "auto" is bfloat16 on GPUs (the optimizer keeps fp32 master weights)
    and float32 on CPU. Where float32 stays on a GPU, its matmuls may use TF32. float16 is
    refused: the loss is a sum with no loss scaling, so its gradients would underflow."""
    if cfg.train.dtype == "float16":
        raise ValueError(
            '[train] dtype = "float16" is not supported: the loss is a sum over tokens with no loss '
            'scaling, so fp16 gradients underflow or overflow; use "bfloat16" (or "auto": bfloat16 '
            "on GPUs, float32 on CPU)"
        )
    dtype = (
        (torch.bfloat16 if on_gpu(device) else torch.float32)
        if cfg.train.dtype == "auto"
        else getattr(torch, cfg.train.dtype)
    )
    if dtype == torch.float32 and on_gpu(device):
        torch.set_float32_matmul_precision("high")
    return dtype


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every floating parameter in ``dtype`` (the engine's flat buffers take one dtype, also
    for modules a class keeps in fp32); buffers stay as the class made them (RoPE frequencies
    are fp32 on purpose: rounded to bf16, long positions lose their angle)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def builds_on_meta(cfg: Config) -> bool:
    """A pretrained model trained with a fixed shard_size > 1 is built on the meta device and
    loaded shard by shard after wrapping (`runtime.meta_init`): no rank holds it whole.
    shard_size "auto" decides from the model's size only when it is wrapped, so it loads whole."""
    s = cfg.train.shard_size
    return bool(cfg.model.pretrained) and isinstance(s, int) and s > 1


def load_model(cfg: Config, device: torch.device) -> tuple[nn.Module, Any]:
    """The model on ``device`` in the run's dtype (`param_dtype`; on the meta device, without
    its weights, when `builds_on_meta`: the trainer loads them after wrapping), and the tokenizer of a
    pretrained transformers directory (else None); with ``[lora]`` rank > 0 wrapped by PEFT
    (`apps.train_lora`: the base frozen, fp32 adapters)."""
    if cfg.lora.rank:
        cfg.lora.check_family("[lora]", cfg.model.family)
        if builds_on_meta(cfg):
            raise ValueError(
                f"[lora] with [train] shard_size = {cfg.train.shard_size} and a pretrained model: the "
                f"model would be built on the meta device, which LoRA does not load into yet; use "
                f'shard_size = 1 or "auto" (the frozen base needs no gradient or optimizer memory)'
            )
    model, tokenizer = _load_base(cfg, device)
    return apply_lora(model, cfg.lora, cfg.model.family, cfg.train.seed), tokenizer


def _load_base(cfg: Config, device: torch.device) -> tuple[nn.Module, Any]:
    m = cfg.model
    dtype = param_dtype(cfg, device)
    meta = builds_on_meta(cfg)
    if not m.pretrained:
        return cast_parameters(build_model(m, cfg.train.seed).to(device), dtype), None
    if m.is_vlm():  # its "tokenizer" is the processor's tokenizer and image processor
        from dcparallel.apps.train_vlm import load_vlm

        model, processor = load_vlm(cfg, device, dtype)
        return cast_parameters(model, dtype), processor
    if m.family == "transformers":
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(m.pretrained, local_files_only=True)
        if meta:
            config = AutoConfig.from_pretrained(m.pretrained, local_files_only=True)
            with empty_init():
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
            return cast_parameters(model, dtype), tokenizer
        model = AutoModelForCausalLM.from_pretrained(
            m.pretrained, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
        )
        return cast_parameters(model.to(device), dtype), tokenizer
    import importlib.util
    import json

    import diffusers

    if importlib.util.find_spec("accelerate") is None:  # diffusers' from_pretrained needs it for Wan and others
        raise ValueError(
            f"loading the diffusers model {m.pretrained} needs accelerate: pip install accelerate "
            f"(or 'dcparallel[train]')"
        )
    name = json.loads((Path(m.pretrained) / "config.json").read_text())["_class_name"]
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ValueError(f"[model] pretrained = {m.pretrained!r} holds a {name}, which this diffusers does not have")
    if meta:
        with empty_init():
            model = cls.from_config(cls.load_config(m.pretrained, local_files_only=True))
        return cast_parameters(model, dtype), None
    model = cls.from_pretrained(m.pretrained, local_files_only=True, torch_dtype=dtype)
    return cast_parameters(model.to(device), dtype), None


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
        ds, sizes = latents_dataset(
            d.path,
            latents_column=d.latents_column,
            text_column=d.text_column,
            channels=c.in_channels,
            text_dim=c.text_dim,
            skip_bad=d.skip_bad,
        )
        if len(set(ds.text_tokens)) > 1:  # the adapter stacks a micro-batch's text embeddings
            first = {n: ds.where(i) for i, n in reversed(list(enumerate(ds.text_tokens)))}
            raise ValueError(
                f"{d.path}: the clips' text embeddings have different lengths ("
                f"{', '.join(f'{n} tokens at {w}' for n, w in sorted(first.items()))}); pad them to one "
                f"length when encoding (Wan pads to 512 tokens)"
            )
        return ds, sizes, ds.text_tokens[0]
    if cfg.model.is_vlm():
        from dcparallel.apps.train_vlm import read_vlm_data

        return (*read_vlm_data(cfg, tokenizer), None)
    from dcparallel.data.text_data import text_dataset

    if tokenizer is None:
        raise ValueError(
            f"[data] path = {d.path!r} needs a tokenizer: [model] pretrained must name a directory "
            f"holding one (save it there with tokenizer.save_pretrained)"
        )
    ds, lengths = text_dataset(
        d.path,
        tokenizer,
        format=d.format or "text",
        field=d.field or None,
        max_tokens=d.max_tokens or None,
        truncate=d.truncate,
        skip_bad=d.skip_bad,
    )
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
    return Data(
        Subset(ds, train_ids), [sizes[i] for i in train_ids], Subset(ds, eval_ids), [sizes[i] for i in eval_ids], tokens
    )


def _synthetic(cfg: Config, model: nn.Module, sizes: list) -> Any:
    from dcparallel.data.synthetic import SyntheticLatents, SyntheticText

    if cfg.model.family == "diffusers":
        c = model.config
        return SyntheticLatents(
            sizes, channels=c.in_channels, text_dim=c.text_dim, text_tokens=cfg.data.text_tokens, seed=cfg.train.seed
        )
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
