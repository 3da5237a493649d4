"""`DataCentricTrainer`: a `transformers.Trainer` whose every optimizer step is a planned step.

    from dcparallel.integrations import DataCentricArguments, DataCentricTrainer
    trainer = DataCentricTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                                 dc_args=DataCentricArguments(tokens_per_step=8192))

`TrainingArguments` keep their meaning (learning rate, scheduler and warmup, weight decay,
Adam betas and epsilon, ``max_grad_norm``, logging, evaluation, saving, resuming,
``report_to``). What changes is the inside of a step: the train loader is
`DataCentricParallel.prepare`'s (one item = this rank's micro-batches of one planned
optimizer step, so ``gradient_accumulation_steps`` must be 1 and batch sizes are not used),
`training_step` runs the micro-batches under `dc.micro_batch` and ends with the step's one
gradient sync (`dc.sync_gradients`), clipping is `dc.clip_grad_norm_`, the optimizer is
`dc.optimizer` (ZeRO-1 AdamW) and the model is not wrapped in DDP.
``gradient_checkpointing`` (or ``activation_checkpointing``) does not turn on transformers'
whole-model checkpointing: recompute is the planner's choice per micro-batch, always.
Evaluation runs transformers' own loop on the unwrapped model.

Checkpoints are the Trainer's own folders plus, in their ``dc_state`` folder, dcparallel's
one checkpoint format (`runtime.sharded_checkpoint`, through torch.distributed.checkpoint:
the fp32 master values and AdamW moments, each rank writing the pieces its optimizer owns,
and the persistent buffers), and the loader's state; `resume_from_checkpoint` continues at
the next planned step (the loader's position follows from the saved global step, the cost
model's refinement from the saved state), at any world size and any shard size (the state
reshards on load). With
``dc_args.refine_steps = N`` the first N steps time each micro-batch and feed the times to
the loader (`DataCentricLoader.observe`, as ``dcparallel train`` does), which plans the later
steps with the corrected cost model.
``bf16=True`` runs each micro-batch's forward under autocast to bfloat16, as the Trainer
does (the parameters, gradients and AdamW states stay fp32, or fp32 masters of a model
loaded in bf16); the profiler measures under the same autocast and the planner counts its
bf16 copies of the fp32 weights (2 bytes a parameter, `runtime.autocast`) in every
micro-batch's memory. ``fp16=True`` (a loss scaler) is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from dcparallel.api import DataCentricParallel
from dcparallel.data import refine
from dcparallel.loss import IGNORE_INDEX
from dcparallel.plan.policies import user_policy
from dcparallel.runtime import sharded_checkpoint as dcp_tensors

#: the optimizers `dc.optimizer` (AdamW with decoupled weight decay) computes exactly
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused")
#: the train loader's `state_dict` in a checkpoint folder
LOADER_STATE = "dc_loader_state.json"
#: the folder of the optimizer state and master values (`runtime.sharded_checkpoint`) in a checkpoint folder
DC_STATE = "dc_state"


@dataclasses.dataclass(kw_only=True)
class DataCentricArguments:
    """How each step is planned (`DataCentricParallel` and `prepare`)."""

    #: planning policy: "dcp", "bucket" or "packed" (`dcparallel.plan.policies.POLICIES`)
    policy: str = "dcp"
    #: tokens per optimizer step (the step budget); give this or ``samples_per_step``
    tokens_per_step: int | None = None
    #: samples per optimizer step, instead of a token budget
    samples_per_step: int | None = None
    #: usable memory per rank in bytes for model states and activations; None: 90% of the device
    memory_bytes: int | None = None
    #: ranks per parameter-shard block (FSDP2); 1: replicated; "auto": the smallest that fits
    shard_size: int | str = 1
    #: "profiled" (measure the model, cached at ``profile_path``) or "analytic" (no profiling)
    cost: str = "profiled"
    #: the cached profile; None: dcparallel_profile.json in the output folder
    profile_path: str | None = None
    #: `ProfilerConfig` fields overriding the quick profile, e.g. {"repeats": 1, "max_repeats": 2}
    profiler_config: dict[str, Any] | None = None
    #: one micro-batch's loss(model, batch, ctx); None: the adapter's (next-token loss for LMs)
    loss_fn: Any = None
    #: the first this many steps' measured micro-batch times correct the cost model (0: off)
    refine_steps: int = 0

    def __post_init__(self) -> None:
        user_policy(self.policy, "DataCentricArguments", flag=None)


class _Tokens:
    """A tokenized dataset as dcparallel's text samples: ``input_ids`` and, where the row has
    ``labels`` (transformers' unshifted labels, -100 where no loss), the next-token targets
    aligned with the inputs, as dcparallel's collate takes them."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        names = getattr(dataset, "column_names", None)
        if names is not None and "input_ids" not in names:
            raise ValueError(
                f"DataCentricTrainer trains on tokenized rows with 'input_ids'; the train dataset has "
                f"columns {sorted(names)}: tokenize it first (dataset.map(tokenizer...))"
            )

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        return [len(self.dataset[i]["input_ids"]) for i in range(len(self))]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.dataset[i]
        ids = torch.as_tensor(row["input_ids"]).reshape(-1)
        if row.get("labels") is None:
            return {"input_ids": ids}
        labels = torch.as_tensor(row["labels"]).reshape(-1)
        if labels.shape != ids.shape:
            raise ValueError(
                f"train row {i}: labels {tuple(labels.shape)} and input_ids {tuple(ids.shape)} differ; "
                f"give one label per token (-100 where no loss)"
            )
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:-1] = labels[1:]
        return {"input_ids": ids, "labels": shifted}


class _EpochFraction(TrainerCallback):
    """``state.epoch`` from the global step (every epoch has the same number of steps):
    right after a resume in the middle of an epoch too, where the loader itself skips the
    steps already trained."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch

    def on_step_end(self, args, state, control, **kwargs):
        state.epoch = state.global_step / self.steps_per_epoch


class _Steps:
    """The train loader as the Trainer sees it: its `set_epoch` also moves the per-sample
    randomness (`DataCentricParallel.set_epoch`)."""

    def __init__(self, dc: DataCentricParallel):
        self.dc = dc

    def __len__(self) -> int:
        return len(self.dc.loader)

    def __iter__(self):
        return iter(self.dc.loader)

    def set_epoch(self, epoch: int) -> None:
        self.dc.set_epoch(epoch)


def _refuse_inexact(a, compute_loss_func) -> None:
    """Refuses the `TrainingArguments` a planned step would not honour exactly, each by name
    with its fix."""
    if a.gradient_accumulation_steps != 1:
        raise ValueError(
            f"gradient_accumulation_steps={a.gradient_accumulation_steps}: each item of the "
            f"data-centric loader is a whole planned step (its micro-batches accumulate inside "
            f"it); set gradient_accumulation_steps=1 and size steps with dc_args.tokens_per_step"
        )
    if a.optim not in ADAMW_NAMES:
        optim = getattr(a.optim, "value", a.optim)
        raise ValueError(
            f"optim={optim!r}: DataCentricTrainer steps with dcparallel's ZeRO-1 AdamW; use "
            f"optim='adamw_torch' (learning rate, betas, epsilon and weight decay are kept)"
        )
    if a.fp16:
        raise ValueError(
            "fp16=True needs a loss scaler, which the planned steps do not run: pass bf16=True "
            "(autocast to bfloat16, no scaling) or load the model in torch.bfloat16 (dcparallel keeps "
            "fp32 master weights and gradients)"
        )
    for name in ("bf16_full_eval", "fp16_full_eval"):
        if getattr(a, name, False):
            raise ValueError(
                f"{name}=True casts the model for evaluation, and its parameters are dcparallel's "
                f"flat buffers: pass {name}=False (evaluation runs under bf16's autocast)"
            )
    if a.label_smoothing_factor or compute_loss_func is not None:
        what = f"label_smoothing_factor={a.label_smoothing_factor}" if a.label_smoothing_factor else "compute_loss_func"
        raise ValueError(
            f"{what}: DataCentricTrainer's steps compute the next-token cross-entropy of each "
            f"micro-batch (the step's mean over all ranks' targets); give dc_args.loss_fn a loss of "
            f"(model, batch, ctx) computing yours instead"
        )
    if a.neftune_noise_alpha is not None:
        raise ValueError(
            f"neftune_noise_alpha={a.neftune_noise_alpha}: NEFTune's embedding noise is not drawn "
            f"per sample by the planned steps (it would differ with the layout); set it to None"
        )


class DataCentricTrainer(Trainer):
    """`transformers.Trainer` with dcparallel's loader, micro-batch loop, gradient sync and
    optimizer (module docstring). ``dc_args``: `DataCentricArguments`; the other arguments
    are the Trainer's (``data_collator`` is used by evaluation only)."""

    def __init__(self, *args: Any, dc_args: DataCentricArguments | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dc_args = dc_args or DataCentricArguments()
        a = self.args
        _refuse_inexact(a, self.compute_loss_func)
        # recompute is chosen per micro-batch by the planner; transformers' own checkpointing
        # of every layer would recompute a second time
        names = [n for n in ("gradient_checkpointing", "activation_checkpointing") if getattr(a, n, False)]
        if names:  # transformers 5 reads activation_checkpointing, its older name an alias
            self.args = a = copy.copy(a)  # the caller's arguments stay as given
            for n in names:
                setattr(a, n, False)
        self.dc = DataCentricParallel(
            self.model,
            policy=self.dc_args.policy,
            memory_bytes=self.dc_args.memory_bytes,
            shard_size=self.dc_args.shard_size,
            seed=a.seed,
            loss_fn=self.dc_args.loss_fn,
            autocast=torch.bfloat16 if a.bf16 else None,  # the forward's autocast: profiled, its copies counted
        )
        self._dc_loader = None

    # ------------------------------------------------------------------ data

    def get_train_dataloader(self):
        """The planned steps of the train dataset (`DataCentricParallel.prepare`), built once."""
        if self._dc_loader is None:
            d = self.dc_args
            data = _Tokens(self.train_dataset)
            path = d.profile_path or os.path.join(self.args.output_dir, "dcparallel_profile.json")
            self._dc_loader = self.dc.prepare(
                data,
                lengths=data.lengths(),
                tokens_per_step=d.tokens_per_step,
                samples_per_step=d.samples_per_step,
                cost=d.cost,
                profile_path=path,
                profiler_config=d.profiler_config,
                collate="text",
                refine_steps=d.refine_steps,
            )
            self._check_epochs_alike(self._dc_loader)
            self.add_callback(_EpochFraction(len(self._dc_loader)))
        return _Steps(self.dc)

    def _check_epochs_alike(self, loader) -> None:
        """The Trainer counts the same number of optimizer steps in every epoch; refused when
        the data-centric steps of the epochs to train differ in number."""
        a = self.args
        epochs = int(-(-a.num_train_epochs // 1)) if a.max_steps <= 0 else -(-a.max_steps // len(loader))
        counts = [len(loader.steps(e)) for e in range(max(1, epochs))]
        if len(set(counts)) > 1:
            raise ValueError(
                f"the epochs' planned steps differ in number ({counts}); the Trainer counts one number "
                f"per epoch: give dc_args.samples_per_step (a fixed number of steps per epoch), or "
                f"train one epoch per call"
            )

    # ------------------------------------------------------------------ the step

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """The optimizer and scheduler on dcparallel's optimizer, no DDP wrapper, state resumed."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        self.model_wrapped = self.model
        # registered with accelerate as prepared (no DDP, no move), so that evaluation does not
        # prepare it itself: its `model.to(device)` re-points the parameters' ``.data``, which
        # are views of dcparallel's flat buffer
        self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        """As the Trainer's; a resume inside an epoch moves the loader itself to the next step
        (it skips by step, not by re-reading batches)."""
        epochs_trained, steps_trained = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        loader = self._dc_loader
        saved = _loader_state(resume_from_checkpoint)  # the measured times the saved run planned with
        if steps_trained > 0 or saved:
            loader.load_state_dict({**(saved or loader.state_dict()), "epoch": epochs_trained, "step": steps_trained})
        return epochs_trained, 0

    def create_optimizer(self, model=None):
        """`dc.optimizer`: ZeRO-1 AdamW over the trainable parameters, with the arguments' lr,
        betas, epsilon and weight decay (on weight matrices, not biases and norms: `Engine.optimizer`)."""
        if self.optimizer is None:
            a = self.args
            self.optimizer = self.dc.optimizer(
                lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon, weight_decay=a.weight_decay
            )
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One planned optimizer step: this rank's micro-batches, then the one gradient sync.
        Returns the step's mean loss over all ranks' targets."""
        model.train()
        loss_fn, loader = self.dc.loss_fn, self._dc_loader
        times = []  # each micro-batch's seconds, for the cost model's refinement (refine_steps)
        for batch in inputs:
            start = time.perf_counter()
            with self.dc.micro_batch(batch) as ctx:
                with self.accelerator.autocast():  # bf16=True: the forward in bfloat16, as the Trainer's
                    loss = loss_fn(model, batch, ctx)
                ctx.backward(loss)
            times.append(refine.seconds_since(start, self.args.device, bool(loader.refine_left)))
        loss = self.dc.sync_gradients()
        loader.observe(inputs, times)  # while refining or tracking (collective), before the next is planned
        return torch.tensor(loss, device=self.args.device)

    def _clip_grad_norm(self, model):
        return self.dc.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm

    def floating_point_ops(self, inputs) -> int:
        return 0

    def _track_num_input_tokens(self, inputs) -> None:
        pass

    # ------------------------------------------------------------------ checkpoints

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The fp32 master values, AdamW's moments and the persistent buffers in the one
        checkpoint format (every rank its owned pieces: collective), and (rank 0) the scheduler
        and the loader's state, in the checkpoint."""
        (Path(output_dir) / DC_STATE).mkdir(parents=True, exist_ok=True)  # every rank writes
        dcp_tensors.save(Path(output_dir) / DC_STATE, self.dc.engine, self.optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / "scheduler.pt")
            # alike on every rank; the refinement's measured times among it (`data.refine`)
            (Path(output_dir) / LOADER_STATE).write_text(json.dumps(self._dc_loader.state_dict()))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The checkpoint's master values, moments and buffers (resharded to this world and
        shard size: collective), then the scheduler and the lr it sets."""
        if checkpoint is None:
            return
        dcp_tensors.load(_state_folder(Path(checkpoint)), self.dc.engine, self.optimizer)
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / "scheduler.pt", weights_only=True))
        # the checkpoint holds no hyperparameters (they are the arguments'): the groups' lr is
        # the scheduler's for the next step, as the uninterrupted run's
        for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr


def _loader_state(checkpoint: str | None) -> dict[str, Any] | None:
    """The loader's state a checkpoint holds; None without one (no checkpoint, or none saved)."""
    path = Path(checkpoint) / LOADER_STATE if checkpoint is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _state_folder(checkpoint: Path) -> Path:
    """The checkpoint's ``dc_state`` folder; ValueError naming why there is none (a folder of
    another Trainer, or of dcparallel 0.1, whose per-rank optimizer files are not read)."""
    folder = checkpoint / DC_STATE
    if (folder / ".metadata").is_file():
        return folder
    if any(checkpoint.glob("dc_optimizer_rank*.pt")):
        raise ValueError(
            f"{checkpoint} holds dcparallel 0.1's per-rank optimizer files (dc_optimizer_rank*.pt), which "
            f"are no longer read: resume it with dcparallel 0.1, or start a new run from its weights "
            f"(from_pretrained({str(checkpoint)!r})) without its optimizer state"
        )
    raise ValueError(f"{checkpoint} has no {DC_STATE}/: resume a DataCentricTrainer from its own checkpoint")
