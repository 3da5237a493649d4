"""`dcparallel train --config FILE.toml`: train a reference model under torchrun.

    torchrun --standalone --nproc-per-node 2 -m dcparallel train --config run.toml
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m dcparallel train --config run.toml

One metrics line per step on rank 0 (loss, tokens/s, step time, idle fraction of the slowest
vs the fastest rank, planned peak memory, SP degrees used, the step's sample ids), a progress
bar on rank 0, the same metrics as JSONL in ``out_dir/metrics.jsonl``, events (start, resume,
injected fault, skipped step, finish) in ``out_dir/events.jsonl``, and a crash-consistent
checkpoint (`dcparallel.checkpoint`: model, ZeRO-1 optimizer shards, loader position, RNG
states, config, profile fingerprint) every ``checkpoint_every`` steps and at the end, in
``out_dir/checkpoint/``.

Started again, a run resumes from its newest committed checkpoint, at any world size (the
optimizer state is resharded, the rest of the epoch re-planned for the new world; the same
samples per step). Metrics lines written after that checkpoint (steps a crash made replay)
are dropped first, so every step appears once. A finished run says so and exits. A checkpoint
written under another config (model, data, policy, step budget, lr, seed, memory) is refused
with what differs, unless ``resume_anyway = true`` (or ``--resume-anyway``).

Everything is checked before anything runs: unknown keys and wrong types or ranges in the
config (named, with the fix), the lengths file (file:line), the step budget, the model's
heads and layers, the fault-injection variable.

The config: `dcparallel.apps.train_config`; fault injection: `dcparallel.apps.faults`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from dcparallel.apps.faults import FAULT_ENV, Fault, append_event, fire, parse_faults
from dcparallel.apps.presets import build_model
from dcparallel.apps.train_config import Config, check_fits, read_train_lengths
from dcparallel.runtime.launch import restart_attempt

log = logging.getLogger("dcparallel.train")


def _dataset(cfg: Config, model, lengths: list):
    """Synthetic samples of the given sizes for the model's family."""
    from dcparallel.data.synthetic import SyntheticLatents, SyntheticText

    if cfg.model.family == "diffusers":
        c = model.config
        return SyntheticLatents(lengths, channels=c.in_channels, text_dim=c.text_dim,
                                text_tokens=cfg.data.text_tokens, seed=cfg.train.seed)
    vocab = model.config.vocab_size if cfg.model.family == "transformers" else cfg.model.vocab_size
    return SyntheticText(lengths, vocab=vocab, seed=cfg.train.seed)



def _loader(cfg: Config, dc, dataset, lengths: list[int], out: Path, rank: int):
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
    config = ProfilerConfig.quick(pc.max_tokens, repeats=pc.repeats, min_time_s=pc.min_time_s, max_mbs=pc.max_mbs,
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


# ---------------------------------------------------------------- the run


def run(cfg: Config) -> int:
    """Trains (or resumes, or reports a finished run); 0 on success. Initializes the process
    group under torchrun (and destroys it at the end) unless one exists already."""
    import faulthandler

    import torch
    import torch.distributed as dist

    from dcparallel.runtime.launch import init_distributed

    cfg.validate()
    t = cfg.train
    faults = parse_faults(os.environ.get(FAULT_ENV, ""))
    lengths = read_train_lengths(cfg)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    own_pg = "RANK" in os.environ and not dist.is_initialized()
    # NCCL + cuda:LOCAL_RANK or gloo; restart-safe under torchrun --max-restarts (runtime/launch.py)
    init_distributed(timeout=timedelta(seconds=t.pg_timeout_s))
    try:
        return _run(cfg, lengths, faults)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()


def _run(cfg: Config, lengths: list[int], faults: list[Fault]) -> int:
    import faulthandler

    import torch
    from tqdm import tqdm

    from dcparallel import DataCentricParallel, checkpoint
    from dcparallel.runtime import comm
    from dcparallel.runtime.launch import init_distributed
    from dcparallel.sim.replay import replay_step

    t = cfg.train
    rank, world = comm.world_rank(), comm.world_size()
    attempt = restart_attempt()
    my_faults = {f.step: f for f in faults if f.rank == rank and f.attempt == attempt}
    out = Path(t.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    events = out / "events.jsonl" if rank == 0 else None
    fault_log = out / "events.jsonl" if my_faults else None
    ckroot = out / "checkpoint"
    if (ckroot / "rank0.pt").exists():
        raise ValueError(f"{ckroot} holds a checkpoint of an older dcparallel (rank*.pt without a commit marker); "
                         f"it cannot be resumed safely: delete {ckroot} or choose another out_dir")

    launch = init_distributed()  # the launch set up in `run`: its device
    cuda = launch.device.type == "cuda"
    model = build_model(cfg.model, cfg.train.seed).to(launch.device)
    dataset = _dataset(cfg, model, lengths)
    extra = {"context_tokens": cfg.data.text_tokens} if cfg.model.family == "diffusers" else {}
    dc = DataCentricParallel(model, policy=t.policy, seed=t.seed, memory_bytes=t.memory_mib * 2**20 or None,
                             **extra)
    lo = min(rank * dc.shard_numel, dc.numel)
    hi = min(lo + dc.shard_numel, dc.numel)

    def reads(marker: dict) -> list[int]:
        files = marker["files"]
        over = [int(r) for r, f in files.items() if max(lo, f["start"]) < min(hi, f["stop"])]
        return sorted({0, *over, *([rank] if str(rank) in files else [])})

    # the checkpoint is found and its config compared before any profiling
    ck = checkpoint.latest(ckroot, reads=reads)
    key = cfg.resume_key()
    if ck is not None:
        diff = _diff(ck.meta.get("config", {}), key)
        if diff and not t.resume_anyway:
            raise ValueError(f"the checkpoint {ck.path} was written under another config: {'; '.join(diff)}. "
                             f"Use the same config, another out_dir, or resume_anyway = true (--resume-anyway)")
        if diff and rank == 0:
            log.warning("resuming %s anyway, although the config differs: %s", ck.path, "; ".join(diff))
        if ck.meta.get("finished") and ck.meta.get("run_length") == [t.epochs, t.max_steps]:
            if rank == 0:  # known without planning (nor profiling at a new world size)
                log.warning("the run in %s already finished: %d of %d steps done; nothing to do (raise max_steps "
                            "or epochs to train more)", out, ck.step, ck.step)
            return 0

    loader = _loader(cfg, dc, dataset, lengths, out, rank)
    opt = dc.optimizer(lr=t.lr)
    profile_fp = dc.profile.fingerprint if getattr(dc, "profile", None) is not None else {"cost": "analytic"}

    done, start_epoch, replayed = 0, 0, 0
    if ck is not None:
        zero = ck.load(0)
        model.load_state_dict(zero["model"])
        opt.load_state_dict([zero["optimizer"] if r == 0 else ck.load(r)["optimizer"]
                             for r in ck.ranks_overlapping(lo, hi)] if hi > lo else [zero["optimizer"]])
        if ck.world_size == world:
            checkpoint.set_rng_state((zero if rank == 0 else ck.load(rank))["rng"])
        loader.load_state_dict(ck.meta["loader"])
        done, start_epoch = ck.step, int(ck.meta["loader"]["epoch"])
        if ck.meta.get("profile") != profile_fp and rank == 0:
            log.warning("the profile differs from the checkpoint's (world size %d -> %d?): the rest of the "
                        "epoch is re-planned, with the same samples per step", ck.world_size, world)
    target = sum(len(loader.steps(e)) for e in range(t.epochs))
    if t.max_steps:
        target = min(target, t.max_steps)
    if done >= target:
        if rank == 0:
            log.warning("the run in %s already finished: %d of %d steps done; nothing to do (raise max_steps or "
                        "epochs to train more)", out, done, target)
        return 0
    if rank == 0:
        replayed = _trim_metrics(out / "metrics.jsonl", done)
        if ck is not None:
            log.warning("resumed from %s at step %d (world size %d -> %d; %d step(s) after it replayed)",
                        ck.path, done, ck.world_size, world, replayed)
            append_event(events, {"event": "resume", "step": done, "replayed": replayed,
                                  "from_world_size": ck.world_size, "world_size": world, "attempt": attempt})
    if rank == 0:
        append_event(events, {"event": "start", "step": done, "world_size": world, "attempt": attempt})

    def save(finished: bool) -> None:
        payload = {"step": done, "rank": rank, "world_size": world, "optimizer": opt.state_dict(),
                   "rng": checkpoint.rng_state()}
        if rank == 0:
            payload["model"] = model.state_dict()
        meta = {"config": key, "profile": profile_fp, "loader": loader.state_dict(), "finished": finished,
                "run_length": [t.epochs, t.max_steps]}
        checkpoint.save(ckroot, done, payload, meta, optimizer_range=(lo, hi), keep=t.keep_checkpoints)

    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None
    total = target - done
    bar = tqdm(total=total, desc=f"train {t.policy}", file=sys.stderr, disable=rank != 0)
    saved_at = done
    try:
        for epoch in range(start_epoch, t.epochs):
            loader.set_epoch(epoch)
            dc.set_epoch(epoch)
            for step in loader:
                t0 = time.perf_counter()
                if cuda:
                    torch.cuda.reset_peak_memory_stats(launch.device)
                if t.step_timeout_s:
                    faulthandler.dump_traceback_later(t.step_timeout_s, exit=True)
                fault = my_faults.get(done + 1)
                if fault is not None and fire(fault, fault_log):
                    # a NaN in this rank's summed loss and gradient, as an overflow would leave; put in
                    # before the step's backward (the overlapped sync may send them during it)
                    dc.zero_grad()
                    dc.flat_grad[0] += float("nan")
                    dc.grad_sync.stats[0] += float("nan")
                busy = 0.0
                for batch in step:
                    a = time.perf_counter()
                    with dc.micro_batch(batch) as ctx:  # the adapter's loss: next-token, or flow matching
                        ctx.backward(dc.loss_fn(model, batch, ctx))
                    busy += time.perf_counter() - a
                loss = dc.sync_gradients()
                finite = math.isfinite(loss)  # the global loss: every rank decides the same
                if finite:
                    opt.step()
                elif t.nan_policy == "stop":
                    raise FloatingPointError(
                        f"step {done + 1} (epoch {epoch}, step {step.index}) has a non-finite loss {loss}; stopped "
                        f"(nan_policy = 'stop'). Resume from the last checkpoint with a lower lr, or set "
                        f"nan_policy = 'skip' to skip such steps")
                else:
                    dc.zero_grad()
                    if rank == 0:
                        log.warning("step %d has a non-finite loss %s: skipped (no update, nan_policy = 'skip')",
                                    done + 1, loss)
                        append_event(events, {"event": "skip", "step": done + 1, "loss": str(loss)})
                done += 1
                step_s = time.perf_counter() - t0
                busys = comm.all_gather_object(busy)
                if t.step_timeout_s:
                    faulthandler.cancel_dump_traceback_later()
                # the plan is the same on every rank: its largest micro-batch is the planned peak
                peak = max((loader.context.mb_memory(mb.sample_ids, mb.layout)
                            for mb in step.plan.micro_batches()), default=0.0)
                record = {"epoch": epoch, "step": step.index, "global_step": done,
                          "loss": loss if finite else None, "skipped": not finite,
                          "tokens": step.num_tokens, "tokens_per_s": step.num_tokens / step_s, "step_s": step_s,
                          "idle_fraction": 1 - min(busys) / max(busys) if max(busys) > 0 else 0.0,
                          "planned_peak_memory_bytes": peak,
                          "planned_compute_s": replay_step(step.plan, loader.context).compute_time,
                          "measured_peak_memory_bytes":
                              torch.cuda.max_memory_allocated(launch.device) if cuda else None,
                          "sp_degrees": step.plan.busy_sizes(),
                          "policy": t.policy, "world_size": world, "sample_ids": sorted(step.plan.sample_ids)}
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                    bar.update(1)
                    bar.write(f"step {done:4d}  loss {loss:.4f}  {record['tokens_per_s']:8.0f} tok/s  "
                              f"{step_s * 1e3:7.0f} ms  idle {100 * record['idle_fraction']:4.1f}%  "
                              f"peak {peak / 2**20:6.1f} MiB  sp {record['sp_degrees']}")
                if done >= target:
                    break  # after the step: the loader's position counts only trained steps
                if t.checkpoint_every and done % t.checkpoint_every == 0:
                    save(finished=False)
                    saved_at = done
            if done >= target:
                break
        if done > saved_at:
            save(finished=True)
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    if rank == 0:
        append_event(events, {"event": "finish", "step": done, "world_size": world})
    return 0
