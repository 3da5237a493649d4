"""`Trainer`: one launch of `dcparallel train` (`dcparallel.apps.train` documents the run).

Set-up (`prepare`: model, data, the checkpoint check, the loader from
`DataCentricParallel.prepare`, the optimizer, resume), the step (`_step`: micro-batches,
`_update`, the metrics `_record`), evaluation (`evaluate`), checkpoints (`_save`) and the
export. A ``before_step`` hook, called at the start of every step, lets its caller act on
the run (the tests inject faults with it)."""

from __future__ import annotations

# every import at the top, none in a function: only a run that trains imports this module (the
# CLI imports `apps.train` lazily, after `train --check`), so torch here slows no CLI start
import faulthandler
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from dcparallel import checkpoint
from dcparallel.api import DataCentricParallel
from dcparallel.apps import train_checkpoint, train_inputs, train_setup
from dcparallel.apps.train_config import Config
from dcparallel.apps.train_log import MetricsSinks, append_event, trim_metrics
from dcparallel.apps.train_setup import builds_on_meta, export_path, load_model, lr_lambda, read_data
from dcparallel.data import refine
from dcparallel.data.loader import DataCentricLoader
from dcparallel.runtime import comm
from dcparallel.runtime.launch import (
    OOM_BUDGET_FACTOR,
    cuda_memory,
    device_memory,
    init_distributed,
    oom_budget,
    oom_restarts,
    record_ooms_in,
    restart_attempt,
)

log = logging.getLogger("dcparallel.train")

#: called with the trainer and the global step about to run (1-based), once the step's
#: watchdog is armed and before its first micro-batch
StepHook = Callable[["Trainer", int], None]


class Update(NamedTuple):
    """What one optimizer step did: its mean loss, the pre-clip gradient norm, the lr it used,
    and whether both were finite (else the step changed nothing, or the run stopped)."""

    loss: float
    grad_norm: float
    lr: float
    finite: bool


def _diff(saved: dict, now: dict) -> list[str]:
    return [
        f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]


class Trainer:
    """One launch of a run: `prepare` (model, data, checkpoint check, loader, optimizer,
    resume) then `train` (the steps, evals, checkpoints, metrics and the export)."""

    def __init__(self, cfg: Config, synthetic_sizes: list, before_step: StepHook | None = None):
        self.cfg, self.t, self.synthetic_sizes = cfg, cfg.train, synthetic_sizes
        self.before_step = before_step
        self.rank, self.world, self.attempt = comm.world_rank(), comm.world_size(), restart_attempt()
        self.out = Path(self.t.out_dir)
        self.launch = init_distributed()  # the launch set up in `run`: its device
        self.cuda = self.launch.device.type == "cuda"
        self.events = self.out / "events.jsonl" if self.rank == 0 else None
        self.done, self.start_epoch, self.resumed_from = 0, 0, None

    # ---------------------------------------------------------------- set-up

    def prepare(self) -> bool:
        """Everything before the first step; False when the run has nothing left to do."""
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        comm.barrier()
        record_ooms_in(self.out)
        self.ckroot = self.out / "checkpoint"
        if (self.ckroot / "rank0.pt").exists():
            raise ValueError(
                f"{self.ckroot} holds a checkpoint of an older dcparallel (rank*.pt without a commit "
                f"marker); it cannot be resumed safely: delete {self.ckroot} or choose another out_dir"
            )
        self.model, self.tokenizer = load_model(self.cfg, self.launch.device)
        self.data = read_data(self.cfg, self.model, self.tokenizer, self.synthetic_sizes)
        self._wrap()
        # the checkpoint is found and its config compared before any profiling
        ck = checkpoint.latest(self.ckroot)
        self.key = self.cfg.resume_key()
        if ck is not None and not self._check_resumable(ck):
            return False
        self.loader = self._loader()
        self.eval_loader = self._eval_loader()
        for ld in filter(None, (self.loader, self.eval_loader)):
            ld.start_planning()  # now, not in step 1's time
        self.opt = self.dc.optimizer(lr=self.t.lr, weight_decay=self.t.weight_decay)
        self.profile_fp = self.dc.profile.fingerprint if self.dc.profile is not None else {"cost": "analytic"}
        if ck is not None:
            self._resume(ck)
        self.target = sum(len(self.loader.steps(e)) for e in range(self.t.epochs))
        self.target = min(self.target, self.t.max_steps or self.target)
        if ck is not None:  # a changed run length moves the lr schedule: refused or stated
            train_checkpoint.check_schedule(
                ck.meta, self.t, self.target, lambda e: len(self.loader.steps(e)), self.done, self.rank
            )
        if self.done >= self.target:
            self._say_finished(self.done, self.target)
            return False
        self.scheduler = self._scheduler()
        return True

    def _wrap(self) -> None:
        """The model in a `DataCentricParallel` (``dc``)."""
        t, extra = self.t, {}
        if self.cfg.model.family == "diffusers":
            extra = {"context_tokens": self.data.context_tokens or self.cfg.data.text_tokens}
        if self.cfg.model.freeze_vision:  # a vision-language model (Config.validate)
            extra = {"freeze_vision": True}
        self.dc = dc = DataCentricParallel(
            self.model,
            policy=t.policy,
            seed=t.seed,
            shard_size=t.shard_size,
            ring=t.ring,
            memory_bytes=self._memory_budget(),
            **extra,
        )
        self.loaded_on_meta = builds_on_meta(self.cfg)  # built on meta: its shards are read now
        if self.loaded_on_meta:
            dc.load_weights(self.cfg.model.pretrained)

    def _memory_budget(self) -> int | None:
        """[train] memory_mib (None: the device's default), times `OOM_BUDGET_FACTOR` for every
        earlier attempt that ran out of memory (`launch.oom_restarts`; the ranks agree on the
        count, so all plan with one budget)."""
        budget = self.t.memory_mib * 2**20 or None
        num_ooms = max(comm.all_gather_object(oom_restarts(self.out)))
        if num_ooms == 0:
            return budget
        base = budget or device_memory(self.launch.device, self.launch.local_world_size)
        lowered = oom_budget(base, num_ooms)
        if self.rank == 0:
            log.warning(
                "%d earlier attempt(s) ran out of memory (%s/oom-*): planning with a memory budget of "
                "%.0f MiB, %g x %.0f MiB",
                num_ooms,
                self.out,
                lowered / 2**20,
                OOM_BUDGET_FACTOR**num_ooms,
                base / 2**20,
            )
        append_event(self.events, {"event": "memory_budget", "bytes": lowered, "oom_restarts": num_ooms})
        return lowered

    def _check_resumable(self, ck) -> bool:
        t = self.t
        diff = _diff(ck.meta.get("config", {}), self.key)
        if diff and not t.resume_anyway:
            raise ValueError(
                f"the checkpoint {ck.path} was written under another config: {'; '.join(diff)}. "
                f"Use the same config, another out_dir, or resume_anyway = true (--resume-anyway)"
            )
        if diff and self.rank == 0:
            log.warning("resuming %s anyway, although the config differs: %s", ck.path, "; ".join(diff))
        if ck.meta.get("finished") and ck.meta.get("run_length") == [t.epochs, t.max_steps]:
            self._say_finished(ck.step, ck.step)  # known without planning (nor profiling at a new world size)
            return False
        return True

    def _say_finished(self, done: int, target: int) -> None:
        if self.rank == 0:
            log.warning(
                "the run in %s already finished: %d of %d steps done; nothing to do (raise max_steps or "
                "epochs to train more; with a cosine / linear lr: --resume-anyway)",
                self.out,
                done,
                target,
            )

    def _loader(self):
        """The training loader from `DataCentricParallel.prepare`: priced by a profile of the
        model (every sample checked first to fit some layout by the analytic model, which
        catches samples the profiler would die on) or by the analytic cost model. Rank 0,
        which writes the metrics, gets each step's prediction with its plan."""
        t, pc, dc, skip = self.t, self.cfg.profile, self.dc, self.cfg.data.skip_oversize
        kw = {**train_setup.loader_workers(self.launch.device, self.launch.local_world_size), "skip_oversize": skip}
        # the profile, or the analytic model's CPU calibration beside it: with the run's outputs
        kw["profile_path"] = Path(pc.path) if pc.path else self.out / "profile.json"
        if pc.cost == "profiled":
            c = dc.cluster_spec
            train_inputs.check_fits(dc.spec, self.data.train_sizes, c.world_size, c.gpus_per_node, c.memory_bytes, skip)
            kw["profiler_config"] = pc.profiler_config(dc.memory_bytes, progress=self.rank == 0)
        return dc.prepare(
            self.data.train,
            lengths=self.data.train_sizes,
            tokens_per_step=t.tokens_per_step,
            cost=pc.cost,
            predict=self.rank == 0,
            refine_steps=pc.refine_steps,
            **kw,
        )

    def _eval_loader(self):
        if self.data.eval is None:
            return None
        dc, t, skip = self.dc, self.t, self.cfg.data.skip_oversize
        return DataCentricLoader(
            self.data.eval,
            self.data.eval_sizes,
            cost=dc.cost,
            cluster=dc.cluster_spec,
            policy=t.policy,
            tokens_per_step=t.tokens_per_step,
            seed=t.seed,
            skip_oversize=skip,
            collate=dc.adapter.collate,
            device=dc.params[0].device,
        )

    def _resume(self, ck) -> None:
        rank = self.rank
        train_checkpoint.load(ck, self.dc, self.opt)  # any world and shard size
        self.opt.param_groups[0]["initial_lr"] = self.t.lr  # the schedule's base is this config's lr
        self.loader.load_state_dict(ck.meta["loader"])
        self.done, self.start_epoch = ck.step, int(ck.meta["loader"]["epoch"])
        self.resumed_from = ck
        if ck.meta.get("profile") != self.profile_fp and rank == 0:
            log.warning(
                "the profile differs from the checkpoint's (world size %d -> %d?): the rest of the "
                "epoch is re-planned, with the same samples per step",
                ck.world_size,
                self.world,
            )
        if ck.shard_size != self.dc.shard_size and rank == 0:
            log.warning("resharded the checkpoint of shard size %d to shard size %d", ck.shard_size, self.dc.shard_size)

    def _scheduler(self):
        """torch's LambdaLR over the optimizer, positioned at the step after ``done``."""
        group = self.opt.param_groups[0]
        group.setdefault("initial_lr", self.t.lr)
        fn = lr_lambda(self.t.warmup_steps, self.target, self.t.schedule)
        return torch.optim.lr_scheduler.LambdaLR(self.opt, fn, last_epoch=self.done - 1)

    # ---------------------------------------------------------------- the loop

    def train(self) -> int:
        """The steps up to the target, then the export; 0."""
        self._log_start()
        self.sinks = MetricsSinks(self.cfg, self.out, self.rank, self.done, self.target - self.done)
        try:
            self._epochs()
        finally:
            self.sinks.close()
        self._export()
        return 0

    def _epochs(self) -> None:
        """Every epoch's steps up to the target; a checkpoint every ``checkpoint_every`` steps
        and one at the end."""
        t = self.t
        saved_at = self.done
        for epoch in range(self.start_epoch, t.epochs):
            self.loader.set_epoch(epoch)
            self.dc.set_epoch(epoch)
            for step in self.loader:
                self._step(epoch, step)
                if self.done >= self.target:
                    break  # after the step: the loader's position counts only trained steps
                if t.checkpoint_every and self.done % t.checkpoint_every == 0:
                    self._save(finished=False)
                    saved_at = self.done
            if self.done >= self.target:
                break
        if self.done > saved_at:
            self._save(finished=True)

    def _step(self, epoch: int, step) -> None:
        """One optimizer step under the step watchdog: the hook, the micro-batches, the
        update, then an eval when due and the step's metrics record."""
        t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.launch.device)
        if self.t.step_timeout_s:
            faulthandler.dump_traceback_later(self.t.step_timeout_s, exit=True)
        if self.before_step is not None:
            self.before_step(self, self.done + 1)
        times = []  # each micro-batch's seconds: the idle share, and the cost model's refinement
        for batch in step:
            a = time.perf_counter()
            with self.dc.micro_batch(batch) as ctx:  # the adapter's loss: next-token, or flow matching
                ctx.backward(self.dc.loss_fn(self.model, batch, ctx))
            times.append(refine.seconds_since(a, self.launch.device, bool(self.loader.refine_left)))
        update = self._update(epoch, step)
        self.loader.observe(step, times)  # while refining or tracking the CPU slowdown (collective); else nothing
        step_s = time.perf_counter() - t0
        idle = self._idle_fraction(sum(times))
        if self.t.step_timeout_s:
            faulthandler.cancel_dump_traceback_later()
        due = self.t.eval_every and (self.done % self.t.eval_every == 0 or self.done >= self.target)
        eval_loss = self.evaluate() if self.eval_loader is not None and due else None
        if self.sinks.active:
            self.sinks.write(self._record(epoch, step, update, step_s, idle, eval_loss))

    def _update(self, epoch: int, step) -> Update:
        """The gradient sync, clipping and the optimizer step (or the nan policy), then the lr
        schedule's step."""
        dc, t = self.dc, self.t
        loss = dc.sync_gradients()
        lr = self.opt.param_groups[0]["lr"]
        # the norm is the same on every rank (whole gradients, or shards' norms all-reduced): all decide alike
        grad_norm = dc.clip_grad_norm_(t.max_grad_norm or math.inf)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
        if finite:
            self.opt.step()
        elif t.nan_policy == "stop":
            raise FloatingPointError(
                f"step {self.done + 1} (epoch {epoch}, step {step.index}) has a non-finite {what}; stopped "
                f"(nan_policy = 'stop'). Resume from the last checkpoint with a lower lr, or set nan_policy = 'skip' "
                f"to skip such steps"
            )
        else:
            dc.zero_grad()
            if self.rank == 0:
                log.warning(
                    "step %d has a non-finite %s: skipped (no update, nan_policy = 'skip')", self.done + 1, what
                )
                append_event(self.events, {"event": "skip", "step": self.done + 1, "loss": str(loss)})
        self.scheduler.step()
        self.done += 1
        return Update(loss, grad_norm, lr, finite)

    def _idle_fraction(self, busy: float) -> float:
        """1 - the least busy rank's micro-batch seconds / the busiest rank's (collective: one
        max-reduction of (busy, -busy))."""
        x = torch.tensor([busy, -busy], dtype=torch.float64, device=self.launch.device)
        most, minus_least = comm.all_reduce_(x, comm.WORLD, op="max").tolist()
        return 1 - (-minus_least) / most if most > 0 else 0.0

    def evaluate(self) -> float:
        """The eval split's loss: every eval step planned by the loader and run on the engine
        without gradients; the summed losses and target counts of all ranks added up (the
        same mean over targets as training's). Per-sample randomness (video noise and
        timesteps) uses epoch 0 at every evaluation, so evaluations compare."""
        dc, epoch = self.dc, self.dc.epoch
        dc.zero_grad()  # the statistics below are this evaluation's only
        dc.engine.set_epoch(0)
        self.eval_loader.set_epoch(0)
        try:
            with torch.no_grad():
                for step in self.eval_loader:
                    for batch in step:
                        with dc.micro_batch(batch, last=False) as ctx:
                            dc.loss_fn(self.model, batch, ctx)
            stats = comm.all_reduce_sum_(dc.grad_sync.stats.clone())
        finally:
            dc.zero_grad()
            dc.engine.set_epoch(epoch)
        loss_sum, count = stats.tolist()
        return loss_sum / count if count > 0 else float("nan")

    # ---------------------------------------------------------------- log, checkpoint, export

    def _log_start(self) -> None:
        """Rank 0: drops metrics lines of steps a restart replays, logs the resume, and writes
        the resume and start events."""
        if self.rank != 0:
            return
        replayed = trim_metrics(self.out / "metrics.jsonl", self.done)
        ck = self.resumed_from
        if ck is not None:
            log.warning(
                "resumed from %s at step %d (world size %d -> %d; %d step(s) after it replayed)",
                ck.path,
                self.done,
                ck.world_size,
                self.world,
                replayed,
            )
            append_event(
                self.events,
                {
                    "event": "resume",
                    "step": self.done,
                    "replayed": replayed,
                    "from_world_size": ck.world_size,
                    "world_size": self.world,
                    "attempt": self.attempt,
                },
            )
        append_event(
            self.events,
            {
                "event": "start",
                "step": self.done,
                "world_size": self.world,
                "attempt": self.attempt,
                "loaded_on_meta": self.loaded_on_meta,
            },
        )

    def _record(self, epoch: int, step, update: Update, step_s: float, idle: float, eval_loss) -> dict:
        """The step's metrics line (rank 0, whose loader predicts each plan: `StepPrediction`)."""
        planned = step.predicted
        return {
            "epoch": epoch,
            "step": step.index,
            "global_step": self.done,
            "loss": update.loss if update.finite else None,
            "skipped": not update.finite,
            "tokens": step.num_tokens,
            "tokens_per_s": step.num_tokens / step_s,
            "step_s": step_s,
            "idle_fraction": idle,
            "planned_peak_memory_bytes": planned.peak_memory_bytes,
            "planned_compute_s": planned.compute_s,
            **cuda_memory(self.launch.device),
            "sp_degrees": step.plan.busy_sizes(),
            "lr": update.lr,
            "grad_norm": update.grad_norm,
            "eval_loss": eval_loss,
            "policy": self.t.policy,
            "world_size": self.world,
            "sample_ids": sorted(step.plan.sample_ids),
        }

    def _save(self, finished: bool) -> None:
        t = self.t
        dtype = getattr(self.dc.grad_sync, "compute_dtype", None) or self.dc.params[0].dtype  # the model's own
        meta = {
            "config": self.key,
            "profile": self.profile_fp,
            "loader": self.loader.state_dict(),
            "finished": finished,
            "run_length": [t.epochs, t.max_steps],
            "shard_size": self.dc.shard_size,
            "dtype": str(dtype).removeprefix("torch."),
        }
        train_checkpoint.save(self.ckroot, self.done, self.dc, self.opt, meta, keep=t.keep_checkpoints)

    def _export(self) -> None:
        """The trained model written to the export directory; the finish event."""
        path = train_checkpoint.export(self.cfg, self.dc, self.tokenizer, export_path(self.cfg, self.out))
        if self.rank == 0:
            if path is not None:
                log.warning("exported the trained model to %s", path)
            append_event(
                self.events,
                {
                    "event": "finish",
                    "step": self.done,
                    "world_size": self.world,
                    **({"export_dir": str(path)} if path else {}),
                },
            )
