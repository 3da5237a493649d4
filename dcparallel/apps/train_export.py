"""`dcparallel export --config run.toml [--step N] [--out DIR]`: a committed checkpoint of a
`dcparallel train` run (any world size, any shard size) exported
as the run's end would export it (`apps.train_checkpoint.write_export`: ``save_pretrained``
+ tokenizer for transformers / diffusers models, ``model.safetensors`` otherwise), in one
process, without a process group and without training. `dcparallel convert-checkpoint
--config run.toml` converts the run's per-rank checkpoints of dcparallel 0.1 in place
(`convert_run`, `apps.checkpoint_convert`).

The model is built as the run built it (``[model]``: the pretrained directory or the config,
in the dtype the run trained in, read from the checkpoint) and its trained parameters are
replaced by the checkpoint's. The checkpoint must have been written under the same
``[model]`` settings (refused otherwise, naming the differences).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from dcparallel import checkpoint
from dcparallel.apps.train_checkpoint import export_checkpoint
from dcparallel.apps.train_config import Config
from dcparallel.apps.train_setup import load_model

log = logging.getLogger("dcparallel.train")


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
    cfg, model, tokenizer = run_model(cfg, ck.meta, ck.path)
    path = out if out is not None else Path(cfg.train.out_dir) / "export" / f"step_{ck.step:08d}"
    return export_checkpoint(ck, model, cfg.model.family, path, tokenizer, merged=cfg.lora.export_merged)


def run_model(cfg: Config, meta: dict, where: Path) -> tuple[Config, Any, Any]:
    """(the config, the model, its tokenizer) built in this process as the run whose
    checkpoint metadata is ``meta`` built them: in the dtype it trained in, whole (shard_size
    1). ValueError, naming the differences, if the checkpoint ``where`` was written under
    other ``[model]`` settings."""
    saved = meta.get("config", {})
    now = cfg.resume_key()
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if k.startswith("model.") and saved.get(k) != now.get(k)
    ]
    if diff:
        raise ValueError(
            f"the checkpoint {where} was written for another model: {'; '.join(diff)}; use "
            f"the config the run was trained with"
        )
    dtype = meta.get("dtype")
    if dtype in ("float32", "bfloat16"):  # the dtype the run trained in (bf16 on GPUs for "auto")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=dtype))
    # one process: the model loads whole (never on the meta device, whatever the run's shard size)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, shard_size=1))
    model, tokenizer = load_model(cfg, torch.device("cpu"))
    return cfg, model, tokenizer


def convert_run(config: Path) -> list[int]:
    """`dcparallel convert-checkpoint`: the per-rank (version 1) checkpoints of the run
    ``config`` describes rewritten in place in the one format (`apps.checkpoint_convert`),
    one process; the steps converted."""
    from dcparallel.apps.checkpoint_convert import convert

    cfg = Config.load(config)
    root = Path(cfg.train.out_dir) / "checkpoint"
    markers = [checkpoint.read_marker(checkpoint.step_dir(root, s), s)[0] for s in checkpoint.committed_steps(root)]
    old = [m for m in markers if m is not None and m["version"] == checkpoint.VERSION_PER_RANK]
    if not old:
        raise ValueError(f"{root} holds no per-rank (version 1) checkpoint to convert")
    _, model, _ = run_model(cfg, old[0]["meta"], root)
    done, left = convert(root, model)
    for why in left:
        log.warning("not converted: %s", why)
    return done
