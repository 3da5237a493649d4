"""`dcparallel train --config FILE.toml`: train or fine-tune a model under torchrun.

    torchrun --standalone --nproc-per-node 2 -m dcparallel train --config run.toml
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m dcparallel train --config run.toml

The model: a local pretrained transformers causal LM or diffusers transformer (``[model]
pretrained``, never downloaded) or one built from the config; the data: a text / chat file
or a latents manifest (``[data] path``; `dcparallel.data.text_dataset` / `latents_dataset`),
for a vision-language folder a JSONL of chats with images (`apps.train_vlm`), or synthetic
samples; optionally an eval split whose loss is measured every ``eval_every``
steps with the same engine and planner, without gradients. The step: AdamW (ZeRO-1) under a
warmup + cosine / linear / constant `torch.optim.lr_scheduler.LambdaLR`, global-norm
clipping (``max_grad_norm``); parameters replicated, or sharded (FSDP2) in blocks of
``shard_size`` ranks; at the end the trained weights are exported to ``export_dir``
(``save_pretrained`` + tokenizer for transformers / diffusers models, a safetensors file
otherwise; `apps.train_checkpoint`). `dcparallel export` exports a committed checkpoint
without training (`apps.train_export`).

One metrics line per step on rank 0 (loss, tokens/s, step time, idle fraction of the slowest
vs the fastest rank, planned peak memory, SP degrees used, lr, gradient norm, eval loss, the
step's sample ids), a progress bar on rank 0, the same metrics as JSONL in
``out_dir/metrics.jsonl`` and, with ``[log]``, TensorBoard / W&B (`apps.train_log`), events (start, resume,
skipped step, finish) in ``out_dir/events.jsonl``, and a crash-consistent
checkpoint (`dcparallel.checkpoint`: model, optimizer state, loader position, RNG states,
config, profile fingerprint; torch.distributed.checkpoint keyed by parameter name, at every
shard size) every ``checkpoint_every`` steps and at the
end, in ``out_dir/checkpoint/``.

Started again, a run resumes from its newest committed checkpoint, at any world size and
shard size (the parameters and optimizer state are resharded, the rest of the epoch
re-planned for the new world; the same samples per step). Metrics lines written after that
checkpoint (steps a crash made replay) are dropped first, so every step appears once. A
finished run says so and exits. A checkpoint written under another config (model, data,
policy, step budget, lr, seed, memory) is refused with what differs, unless
``resume_anyway = true`` (or ``--resume-anyway``); so is a changed run length (epochs,
max_steps) that would move a cosine / linear lr (a constant one's new length is stated).
Messages and progress bars come from rank 0; the other ranks log errors only
(`runtime.launch.quiet_other_ranks`). ``dcparallel train --check --config FILE`` checks the
config, its lengths file and its dataset in one process before torchrun starts any worker.

Everything is checked before anything runs: unknown keys and wrong types or ranges in the
config (named, with the fix), the lengths file (file:line), the step budget, the model's
heads and layers.

The config: `dcparallel.apps.train_config`; model, data and schedule:
`dcparallel.apps.train_setup`; the loop: `dcparallel.apps.trainer`; checkpoints and export:
`dcparallel.apps.train_checkpoint`; metrics and events: `dcparallel.apps.train_log`.
"""

from __future__ import annotations

import os
from datetime import timedelta

from dcparallel.apps.train_config import Config
from dcparallel.apps.train_inputs import read_train_lengths
from dcparallel.apps.trainer import StepHook, Trainer


def run(cfg: Config, before_step: StepHook | None = None) -> int:
    """Trains (or resumes, or reports a finished run); 0 on success. Initializes the process
    group under torchrun (and destroys it at the end) unless one exists already.
    ``before_step(trainer, global_step)`` is called at the start of every step (`Trainer`)."""
    import faulthandler

    import torch
    import torch.distributed as dist

    from dcparallel.runtime.launch import init_distributed

    cfg.validate()
    t = cfg.train
    lengths = read_train_lengths(cfg)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    own_pg = "RANK" in os.environ and not dist.is_initialized()
    # NCCL + cuda:LOCAL_RANK or gloo; restart-safe under torchrun --max-restarts (runtime/launch.py)
    init_distributed(timeout=timedelta(seconds=t.pg_timeout_s))
    try:
        trainer = Trainer(cfg, lengths, before_step)
        return trainer.train() if trainer.prepare() else 0
    finally:
        faulthandler.cancel_dump_traceback_later()
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()
