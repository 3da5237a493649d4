"""`Trainer`: one launch of `dcparallel train` (`dcparallel.apps.train` documents the run):
set-up and resume, the steps with clipping and the lr schedule, evaluation, checkpoints,
metrics and the export."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

from dcparallel.apps.faults import Fault, append_event, fire
from dcparallel.apps.train_config import Config, check_fits
from dcparallel.runtime.launch import restart_attempt

log = logging.getLogger("dcparallel.train")


def _loader(cfg: Config, dc, dataset, lengths: list, out: Path, rank: int):
    from dcparallel.profile.profiler import ProfilerConfig

    t, pc = cfg.train, cfg.profile
    if pc.cost == "analytic":
        from dcparallel.cost.analytic import AnalyticCost
        from dcparallel.data import DataCentricLoader
        from dcparallel.data.sizes import check_step_budget

        check_step_budget(t.tokens_per_step, None)
        cluster = dataclasses.replace(dc.cluster_spec, intra_bw=dc.cluster_spec.intra_bw or 1e10,
                                      inter_bw=dc.cluster_spec.inter_bw or 1e10)
        dc.cost = AnalyticCost(dc.spec, cluster)
        dc.loader = DataCentricLoader(dataset, lengths, cost=dc.cost, cluster=dc.cluster_spec, policy=t.policy,
                                      tokens_per_step=t.tokens_per_step, seed=t.seed, collate=dc.adapter.collate,
                                      device=dc.params[0].device)  # the adapter's collate, as prepare uses
        return dc.loader
    check_fits(dc.spec, lengths, dc.cluster_spec.world_size, dc.cluster_spec.gpus_per_node, dc.memory_bytes)
    config = ProfilerConfig.quick(pc.max_tokens, repeats=pc.repeats, max_repeats=max(pc.repeats, pc.max_repeats),
                                  min_time_s=pc.min_time_s, max_mbs=pc.max_mbs,
                                  memory_limit=dc.memory_bytes, progress=rank == 0)
    return dc.prepare(dataset, lengths=lengths, tokens_per_step=t.tokens_per_step,
                      profile_path=Path(pc.path) if pc.path else out / "profile.json", profiler_config=config)


def _trim_metrics(path: Path, done: int) -> int:
    """Drops metrics lines of steps after ``done`` (replayed after a restart); returns how many."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1  # a torn last line
            continue
        if rec.get("global_step", 0) <= done:
            keep.append(line)
        else:
            dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    tmp.replace(path)
    return dropped


def _diff(saved: dict, now: dict) -> list[str]:
    return [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]


class Trainer:
    """One launch of a run: `prepare` (model, data, checkpoint check, loader, optimizer,
    resume) then `train` (the steps, evals, checkpoints, metrics and the export)."""

    def __init__(self, cfg: Config, synthetic_sizes: list, faults: list[Fault]):
        from dcparallel.runtime import comm
        from dcparallel.runtime.launch import init_distributed

        self.cfg, self.t, self.synthetic_sizes = cfg, cfg.train, synthetic_sizes
        self.rank, self.world = comm.world_rank(), comm.world_size()
        self.attempt = restart_attempt()
        self.faults = {f.step: f for f in faults if f.rank == self.rank and f.attempt == self.attempt}
        self.out = Path(self.t.out_dir)
        self.launch = init_distributed()  # the launch set up in `run`: its device
        self.cuda = self.launch.device.type == "cuda"
        self.events = self.out / "events.jsonl" if self.rank == 0 else None
        self.done, self.start_epoch = 0, 0

    # ---------------------------------------------------------------- set-up

    def prepare(self) -> bool:
        """Everything before the first step; False when the run has nothing left to do."""
        from dcparallel import DataCentricParallel, checkpoint
        from dcparallel.apps import train_checkpoint
        from dcparallel.apps.train_setup import load_model, read_data
        from dcparallel.runtime import comm

        t, rank = self.t, self.rank
        if rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        comm.barrier()
        self.ckroot = self.out / "checkpoint"
        if (self.ckroot / "rank0.pt").exists():
            raise ValueError(f"{self.ckroot} holds a checkpoint of an older dcparallel (rank*.pt without a commit "
                             f"marker); it cannot be resumed safely: delete {self.ckroot} or choose another out_dir")
        self.model, self.tokenizer = load_model(self.cfg, self.launch.device)
        self.data = read_data(self.cfg, self.model, self.tokenizer, self.synthetic_sizes)
        extra = {}
        if self.cfg.model.family == "diffusers":
            extra = {"context_tokens": self.data.context_tokens or self.cfg.data.text_tokens}
        self.dc = dc = DataCentricParallel(self.model, policy=t.policy, seed=t.seed,
                                           memory_bytes=t.memory_mib * 2**20 or None, shard_size=t.shard_size,
                                           **extra)
        # this rank's ZeRO-1 range of the flat optimizer state (shard_size 1 only)
        self.opt_range = None
        if dc.shard_size == 1:
            lo = min(rank * dc.shard_numel, dc.numel)
            self.opt_range = (lo, min(lo + dc.shard_numel, dc.numel))
        # the checkpoint is found and its config compared before any profiling
        ck = checkpoint.latest(self.ckroot, reads=lambda marker: train_checkpoint.reads(marker, rank, self.opt_range))
        self.key = self.cfg.resume_key()
        if ck is not None and not self._check_resumable(ck):
            return False
        self.loader = _loader(self.cfg, dc, self.data.train, self.data.train_sizes, self.out, rank)
        self.eval_loader = self._eval_loader()
        self.opt = dc.optimizer(lr=t.lr, weight_decay=t.weight_decay)
        self.profile_fp = dc.profile.fingerprint if getattr(dc, "profile", None) is not None else {"cost": "analytic"}
        if ck is not None:
            self._resume(ck)
        self.target = sum(len(self.loader.steps(e)) for e in range(t.epochs))
        if t.max_steps:
            self.target = min(self.target, t.max_steps)
        if self.done >= self.target:
            if rank == 0:
                log.warning("the run in %s already finished: %d of %d steps done; nothing to do (raise max_steps or "
                            "epochs to train more)", self.out, self.done, self.target)
            return False
        self.scheduler = self._scheduler()
        return True

    def _check_resumable(self, ck) -> bool:
        t = self.t
        diff = _diff(ck.meta.get("config", {}), self.key)
        if diff and not t.resume_anyway:
            raise ValueError(f"the checkpoint {ck.path} was written under another config: {'; '.join(diff)}. "
                             f"Use the same config, another out_dir, or resume_anyway = true (--resume-anyway)")
        if diff and self.rank == 0:
            log.warning("resuming %s anyway, although the config differs: %s", ck.path, "; ".join(diff))
        if ck.meta.get("finished") and ck.meta.get("run_length") == [t.epochs, t.max_steps]:
            if self.rank == 0:  # known without planning (nor profiling at a new world size)
                log.warning("the run in %s already finished: %d of %d steps done; nothing to do (raise max_steps "
                            "or epochs to train more)", self.out, ck.step, ck.step)
            return False
        return True

    def _eval_loader(self):
        if self.data.eval is None:
            return None
        from dcparallel.data import DataCentricLoader

        dc = self.dc
        return DataCentricLoader(self.data.eval, self.data.eval_sizes, cost=dc.cost, cluster=dc.cluster_spec,
                                 policy=self.t.policy, tokens_per_step=self.t.tokens_per_step, seed=self.t.seed,
                                 collate=dc.adapter.collate, device=dc.params[0].device)

    def _resume(self, ck) -> None:
        from dcparallel.apps import train_checkpoint

        rank = self.rank
        train_checkpoint.load(ck, self.dc, self.opt, self.opt_range)  # any version, world and shard size
        self.opt.param_groups[0]["initial_lr"] = self.t.lr  # the schedule's base is this config's lr
        self.loader.load_state_dict(ck.meta["loader"])
        self.done, self.start_epoch = ck.step, int(ck.meta["loader"]["epoch"])
        self.resumed_from = ck
        if ck.meta.get("profile") != self.profile_fp and rank == 0:
            log.warning("the profile differs from the checkpoint's (world size %d -> %d?): the rest of the "
                        "epoch is re-planned, with the same samples per step", ck.world_size, self.world)
        if ck.shard_size != self.dc.shard_size and rank == 0:
            log.warning("resharded the checkpoint of shard size %d to shard size %d", ck.shard_size,
                        self.dc.shard_size)

    def _scheduler(self):
        """torch's LambdaLR over the optimizer, positioned at the step after ``done``."""
        import torch

        from dcparallel.apps.train_setup import lr_lambda

        group = self.opt.param_groups[0]
        group.setdefault("initial_lr", self.t.lr)
        fn = lr_lambda(self.t.warmup_steps, self.target, self.t.schedule)
        return torch.optim.lr_scheduler.LambdaLR(self.opt, fn, last_epoch=self.done - 1)

    # ---------------------------------------------------------------- the loop

    def train(self) -> int:
        from dcparallel.apps.train_log import MetricsSinks

        t, rank = self.t, self.rank
        if rank == 0:
            replayed = _trim_metrics(self.out / "metrics.jsonl", self.done)
            ck = getattr(self, "resumed_from", None)
            if ck is not None:
                log.warning("resumed from %s at step %d (world size %d -> %d; %d step(s) after it replayed)",
                            ck.path, self.done, ck.world_size, self.world, replayed)
                append_event(self.events, {"event": "resume", "step": self.done, "replayed": replayed,
                                           "from_world_size": ck.world_size, "world_size": self.world,
                                           "attempt": self.attempt})
            append_event(self.events, {"event": "start", "step": self.done, "world_size": self.world,
                                       "attempt": self.attempt})
        self.sinks = MetricsSinks(self.cfg, self.out, rank, self.done, self.target - self.done)
        saved_at = self.done
        try:
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
        finally:
            self.sinks.close()
        from dcparallel.apps import train_checkpoint
        from dcparallel.apps.train_setup import export_path

        path = train_checkpoint.export(self.cfg.model.family, self.dc, self.tokenizer, export_path(self.cfg, self.out))
        if rank == 0:
            if path is not None:
                log.warning("exported the trained model to %s", path)
            append_event(self.events, {"event": "finish", "step": self.done, "world_size": self.world,
                                       **({"export_dir": str(path)} if path else {})})
        return 0

    def _step(self, epoch: int, step) -> None:
        """One optimizer step: micro-batches, sync, clipping, update (or the nan policy), the
        lr schedule, an eval when due, and the step's metrics record."""
        import faulthandler

        import torch

        from dcparallel.runtime import comm

        t, dc, rank = self.t, self.dc, self.rank
        t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.launch.device)
        if t.step_timeout_s:
            faulthandler.dump_traceback_later(t.step_timeout_s, exit=True)
        fault = self.faults.get(self.done + 1)
        if fault is not None and fire(fault, self.out / "events.jsonl"):
            # a NaN in this rank's summed loss and gradient, as an overflow would leave; put in
            # before the step's backward (the overlapped sync may send them during it)
            dc.zero_grad()
            dc.flat_grad[0] += float("nan")
            dc.grad_sync.stats[0] += float("nan")
        busy = 0.0
        for batch in step:
            a = time.perf_counter()
            with dc.micro_batch(batch) as ctx:  # the adapter's loss: next-token, or flow matching
                ctx.backward(dc.loss_fn(self.model, batch, ctx))
            busy += time.perf_counter() - a
        loss = dc.sync_gradients()
        lr = self.opt.param_groups[0]["lr"]
        # the synced gradients are the same on every rank: every rank decides the same
        grad_norm = dc.clip_grad_norm_(t.max_grad_norm or math.inf)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
        if finite:
            self.opt.step()
        elif t.nan_policy == "stop":
            raise FloatingPointError(
                f"step {self.done + 1} (epoch {epoch}, step {step.index}) has a non-finite {what}; stopped "
                f"(nan_policy = 'stop'). Resume from the last checkpoint with a lower lr, or set nan_policy = 'skip' "
                f"to skip such steps")
        else:
            dc.zero_grad()
            if rank == 0:
                log.warning("step %d has a non-finite %s: skipped (no update, nan_policy = 'skip')",
                            self.done + 1, what)
                append_event(self.events, {"event": "skip", "step": self.done + 1, "loss": str(loss)})
        self.scheduler.step()
        self.done += 1
        step_s = time.perf_counter() - t0
        busys = comm.all_gather_object(busy)
        if t.step_timeout_s:
            faulthandler.cancel_dump_traceback_later()
        due = t.eval_every and (self.done % t.eval_every == 0 or self.done >= self.target)
        eval_loss = self.evaluate() if self.eval_loader is not None and due else None
        self.sinks.write(self._record(epoch, step, loss if finite else None, finite, step_s, busys, lr, grad_norm,
                                      eval_loss))

    def evaluate(self) -> float:
        """The eval split's loss: every eval step planned by the loader and run on the engine
        without gradients; the summed losses and target counts of all ranks added up (the
        same mean over targets as training's). Per-sample randomness (video noise and
        timesteps) uses epoch 0 at every evaluation, so evaluations compare."""
        import torch

        from dcparallel.runtime import comm

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

    def _record(self, epoch, step, loss, finite, step_s, busys, lr, grad_norm, eval_loss) -> dict:
        import torch

        from dcparallel.sim.replay import replay_step

        loader = self.loader
        # the plan is the same on every rank: its largest micro-batch is the planned peak
        peak = max((loader.context.mb_memory(mb.sample_ids, mb.layout) for mb in step.plan.micro_batches()),
                   default=0.0)
        return {"epoch": epoch, "step": step.index, "global_step": self.done, "loss": loss, "skipped": not finite,
                "tokens": step.num_tokens, "tokens_per_s": step.num_tokens / step_s, "step_s": step_s,
                "idle_fraction": 1 - min(busys) / max(busys) if max(busys) > 0 else 0.0,
                "planned_peak_memory_bytes": peak,
                "planned_compute_s": replay_step(step.plan, loader.context).compute_time,
                "measured_peak_memory_bytes":
                    torch.cuda.max_memory_allocated(self.launch.device) if self.cuda else None,
                "sp_degrees": step.plan.busy_sizes(), "lr": lr, "grad_norm": grad_norm, "eval_loss": eval_loss,
                "policy": self.t.policy, "world_size": self.world, "sample_ids": sorted(step.plan.sample_ids)}

    def _save(self, finished: bool) -> None:
        from dcparallel.apps import train_checkpoint

        t = self.t
        dtype = getattr(self.dc.grad_sync, "compute_dtype", None) or self.dc.params[0].dtype  # the model's own
        meta = {"config": self.key, "profile": self.profile_fp, "loader": self.loader.state_dict(),
                "finished": finished, "run_length": [t.epochs, t.max_steps], "shard_size": self.dc.shard_size,
                "dtype": str(dtype).removeprefix("torch.")}
        train_checkpoint.save(self.ckroot, self.done, self.dc, self.opt, meta, keep=t.keep_checkpoints,
                              optimizer_range=self.opt_range or (0, 0))
