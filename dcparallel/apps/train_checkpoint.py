"""How `dcparallel train` saves and resumes its tensors, and exports the trained model.

Checkpoints (`dcparallel.checkpoint`): `torch.distributed.checkpoint` for every shard size,
every tensor keyed by parameter name (`runtime.sharded_checkpoint`: the fp32 master values and
the AdamW moments each rank's optimizer owns, and the model's persistent buffers, replicated);
they load at any world size and any shard size through DCP's resharding (into `ShardedAdamW`
or `ZeroAdamW`). Frozen parameters are not saved (no step changes them): a LoRA run's
checkpoint holds the adapters only; the frozen base comes back from the model as built.

Export: ``save_pretrained`` (+ tokenizer) for transformers and diffusers models, a
``model.safetensors`` file of the state dict for other models, the PEFT adapter folder for a
LoRA run (`apps.train_lora`), written by rank 0. With
shard_size > 1 the full state dict is gathered first
(`torch.distributed.checkpoint.state_dict.get_model_state_dict`, collective, onto rank 0's CPU)
and loaded into a copy of the model built on the meta device; the export holds the weights in
the model's own dtype. `export_checkpoint` does the same from a committed checkpoint, in one
process without training (`dcparallel export`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dcparallel import checkpoint
from dcparallel.apps.train_lora import is_lora, write_lora_export
from dcparallel.runtime import comm
from dcparallel.runtime import sharded_checkpoint as dcp_tensors

log = logging.getLogger("dcparallel.train")


def save(root: Path, step: int, dc, opt, meta: dict, *, keep: int) -> Path:
    """The run's checkpoint of ``step`` (collective; module docstring)."""
    return checkpoint.save(
        root, step, lambda path: dcp_tensors.save(path, dc.engine, opt), meta, shard_size=dc.shard_size, keep=keep
    )


def load(ck: checkpoint.Committed, dc, opt) -> None:
    """The checkpoint's parameters and optimizer state into ``dc`` / ``opt``, and this rank's
    RNG states when the world size is the checkpoint's (collective)."""
    dcp_tensors.load(ck.path, dc.engine, opt)
    if ck.world_size == comm.world_size():
        checkpoint.set_rng_state(ck.load_rng(comm.world_rank()))


# ---------------------------------------------------------------- export


def _unwrapped_class(model: nn.Module) -> type:
    """The model's own class (FSDP2 swaps in a subclass of it)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def write_export(
    family: str,
    model: nn.Module,
    path: Path,
    tokenizer: Any = None,
    state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    merged: bool = False,
) -> None:
    """Writes the model to ``path`` (one process): ``state`` (a full state dict) replaces the
    model's own when given, cast to ``dtype``. A PEFT model writes its adapter folder (and with
    ``merged`` the merged model under ``merged/``: `apps.train_lora.write_lora_export`)."""
    if is_lora(model):
        write_lora_export(model, path, tokenizer, state, merged)
        return
    if family == "reference":
        from safetensors.torch import save_file

        sd = state if state is not None else model.state_dict()
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to(dtype or v.dtype).contiguous() for k, v in sd.items()}, path / "model.safetensors")
        return
    if state is not None:
        cls = _unwrapped_class(model)
        with torch.device("meta"):
            shell = cls._from_config(model.config) if family == "transformers" else cls.from_config(model.config)
        shell.load_state_dict({k: v.to(dtype or v.dtype) for k, v in state.items()}, strict=False, assign=True)
        meta = [n for n, t in [*shell.named_parameters(), *shell.named_buffers()] if t.is_meta]
        missing = [n for n in meta if n in dict(shell.named_parameters())]
        if missing:
            raise ValueError(f"the gathered state dict of {cls.__name__} lacks {missing[:5]}; cannot export it")
        for n, b in list(shell.named_buffers()):  # non-persistent buffers: the trained model's own
            if b.is_meta:
                owner, _, leaf = n.rpartition(".")
                src = model.get_buffer(n)
                shell.get_submodule(owner).register_buffer(leaf, src.detach().cpu().clone(), persistent=False)
        model = shell
    model.save_pretrained(path)  # the runtime's attention is not part of the saved config
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def export(cfg, dc, tokenizer: Any, path: Path | None) -> Path | None:
    """The trained model of the run ``cfg`` (`apps.train_config.Config`) exported to ``path``
    by rank 0 (collective; module docstring)."""
    if path is None:
        return None
    state, dtype = None, None
    if dc.shard_size > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(dc.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        dtype = dc.grad_sync.compute_dtype
    if comm.world_rank() == 0:
        write_export(cfg.model.family, dc.model, path, tokenizer, state, dtype, merged=cfg.lora.export_merged)
    comm.barrier()
    return path


def export_checkpoint(
    ck: checkpoint.Committed, model: nn.Module, family: str, path: Path, tokenizer: Any = None, merged: bool = False
) -> Path:
    """Exports a committed checkpoint of any shard size (one process, no process group):
    ``model`` is the run's model as built at its start (its frozen parameters); the
    checkpoint's trained parameters and persistent buffers replace its own."""
    dtype = next(model.parameters()).dtype
    trained = dcp_tensors.read_model(ck.path)
    params = dict(model.named_parameters())
    unknown = sorted(set(trained) - set(params))
    if unknown:
        raise ValueError(
            f"{ck.path} holds parameters {unknown[:5]} this model does not have; export with the "
            f"config the run was trained with"
        )
    buffers = dcp_tensors.persistent_buffers(model)
    saved = dcp_tensors.read_buffers(ck.path)
    if set(saved) != set(buffers):
        raise ValueError(
            f"{ck.path} holds the persistent buffers {sorted(saved)[:5]}, this model has {sorted(buffers)[:5]}; "
            f"export with the config the run was trained with"
        )
    with torch.no_grad():
        for name, value in trained.items():
            params[name].copy_(value.view(params[name].shape).to(dtype))
        for name, value in saved.items():
            buffers[name].copy_(value.view(buffers[name].shape))
    write_export(family, model, path, tokenizer, merged=merged)
    return path


def check_schedule(meta: dict, t: Any, target: int, steps_in_epoch: Any, done: int, rank: int) -> None:
    """A resumed run whose length changed ([train] epochs / max_steps): the lr schedule's
    total steps change with it. Where that changes the lr of the next step (cosine, linear)
    it is refused unless ``resume_anyway``, naming both lrs; otherwise it is stated (rank 0).
    ``steps_in_epoch(e)``: the steps of epoch e; ``meta``: the checkpoint's."""
    from dcparallel.apps.train_setup import lr_lambda

    old_epochs, old_max = meta.get("run_length", [t.epochs, t.max_steps])
    if [old_epochs, old_max] == [t.epochs, t.max_steps]:
        return
    old_target = sum(steps_in_epoch(e) for e in range(old_epochs))
    old_target = min(old_target, old_max or old_target)
    if old_target == target:
        return
    was = t.lr * lr_lambda(t.warmup_steps, old_target, t.schedule)(done)
    now = t.lr * lr_lambda(t.warmup_steps, target, t.schedule)(done)
    what = (
        f"the run's length changed (epochs {old_epochs} -> {t.epochs}, max_steps {old_max} -> {t.max_steps}): "
        f"it now ends at step {target}, not {old_target}"
    )
    if not math.isclose(was, now, rel_tol=1e-12) and not t.resume_anyway:
        raise ValueError(
            f"{what}, and the {t.schedule} lr of step {done + 1} would jump from {was:.4g} to "
            f"{now:.4g}. Resume with the same epochs and max_steps (then start a new run from the "
            f"export), or resume_anyway = true (--resume-anyway) to continue on the new schedule"
        )
    if rank == 0:
        log.warning("%s; the %s lr of step %d: %.4g (was %.4g)", what, t.schedule, done + 1, now, was)
