"""`dcparallel export --config run.toml [--step N] [--out DIR]`: a committed checkpoint of a
`dcparallel train` run (any world size, any shard size, either checkpoint version) exported
as the run's end would export it (`apps.train_checkpoint.write_export`: ``save_pretrained``
+ tokenizer for transformers / diffusers models, ``model.safetensors`` otherwise), in one
process, without a process group and without training.

The model is built as the run built it (``[model]``: the pretrained directory or the config,
in the dtype the run trained in, read from the checkpoint) and its trained parameters are
replaced by the checkpoint's. The checkpoint must have been written under the same
``[model]`` settings (refused otherwise, naming the differences).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dcparallel import checkpoint
from dcparallel.apps.train_checkpoint import export_checkpoint
from dcparallel.apps.train_config import Config
from dcparallel.apps.train_setup import load_model


def export_run(config: Path, out: Path | None = None, step: int | None = None) -> Path:
    """Exports the newest committed checkpoint (or that of ``step``) of the run ``config``
    describes; the directory written."""
    cfg = Config.load(config)
    root = Path(cfg.train.out_dir) / "checkpoint"
    if step is None:
        ck = checkpoint.latest(root)
        if ck is None:
            raise ValueError(f"{root} holds no committed checkpoint: train first (dcparallel train --config {config})")
    else:
        ck, why = checkpoint.verify(root, step)
        if ck is None:
            raise ValueError(f"cannot export step {step}: {why}; committed steps: {checkpoint.committed_steps(root)}")
    saved = ck.meta.get("config", {})
    now = cfg.resume_key()
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if k.startswith("model.") and saved.get(k) != now.get(k)
    ]
    if diff:
        raise ValueError(
            f"the checkpoint {ck.path} was written for another model: {'; '.join(diff)}; export with "
            f"the config the run was trained with"
        )
    dtype = ck.meta.get("dtype")
    if dtype in ("float32", "bfloat16"):  # the dtype the run trained in (bf16 on GPUs for "auto")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=dtype))
    # one process: the model loads whole (never on the meta device, whatever the run's shard size)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, shard_size=1))
    model, tokenizer = load_model(cfg, torch.device("cpu"))
    path = out if out is not None else Path(cfg.train.out_dir) / "export" / f"step_{ck.step:08d}"
    return export_checkpoint(ck, model, cfg.model.family, path, tokenizer, merged=cfg.lora.export_merged)
