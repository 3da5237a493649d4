"""`dcparallel train --config FILE.toml`: train a reference model under torchrun.

    torchrun --standalone --nproc-per-node 2 -m dcparallel.cli train --config run.toml

One metrics line per step on rank 0 (loss, tokens/s, step time, idle fraction of the slowest
vs the fastest rank, planned peak memory, SP degrees used), a progress bar on rank 0, the
same metrics as JSONL in ``out_dir/metrics.jsonl``, and a checkpoint (model, optimizer shard,
loader position) every ``checkpoint_every`` steps in ``out_dir/checkpoint/``; a run started
again with the same config resumes from it.

Config (every key optional; defaults below)::

    [model]
    kind = "llama"          # "llama" (text) or "dit" (video)
    hidden = 128
    num_layers = 4
    num_heads = 4
    ffn_hidden = 352        # llama only
    vocab_size = 256        # llama only

    [data]
    lengths = "builtin"     # or a file: one token count a line
    num_samples = 200       # builtin: how many samples

    [train]
    policy = "dcp"
    tokens_per_step = 8192
    epochs = 1
    max_steps = 0           # 0: no limit
    lr = 0.003
    seed = 0
    memory_mib = 0          # per-rank budget; 0: the device's memory
    out_dir = "runs/train"
    checkpoint_every = 0    # 0: never

    [profile]               # how much the profiler measures (cached in out_dir/profile.json)
    repeats = 3             # timed runs per layout (median)
    max_mbs = 16            # micro-batch sizes doubled up to this
    max_tokens = 4096       # ... or up to this many tokens
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import tomllib

log = logging.getLogger("dcparallel.train")


@dataclass(kw_only=True)
class ModelConfig:
    kind: str = "llama"
    hidden: int = 128
    num_layers: int = 4
    num_heads: int = 4
    ffn_hidden: int = 352
    vocab_size: int = 256


@dataclass(kw_only=True)
class DataConfig:
    lengths: str = "builtin"
    num_samples: int = 200


@dataclass(kw_only=True)
class TrainConfig:
    policy: str = "dcp"
    tokens_per_step: int = 8192
    epochs: int = 1
    max_steps: int = 0
    lr: float = 3e-3
    seed: int = 0
    memory_mib: int = 0
    out_dir: str = "runs/train"
    checkpoint_every: int = 0


@dataclass(kw_only=True)
class ProfileConfig:
    repeats: int = 3
    max_mbs: int = 16
    max_tokens: int = 4096


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    @staticmethod
    def load(path: str | Path) -> Config:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read the config {p}: {exc}") from exc
        out = Config()
        for section, cls in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig),
                             ("profile", ProfileConfig)):
            values = raw.pop(section, {})
            known = {f.name for f in fields(cls)}
            bad = sorted(set(values) - known)
            if bad:
                raise ValueError(f"{p}: unknown key(s) {bad} in [{section}]; known: {sorted(known)}")
            setattr(out, section, cls(**values))
        if raw:
            raise ValueError(f"{p}: unknown section(s) {sorted(raw)}; use [model], [data], [train], [profile]")
        if out.model.kind not in ("llama", "dit"):
            raise ValueError(f"{p}: [model] kind must be 'llama' or 'dit'; got {out.model.kind!r}")
        return out


def _build(cfg: Config):
    import torch

    from dcparallel.models.llama import Llama, LlamaConfig

    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    return Llama(LlamaConfig(vocab_size=m.vocab_size, hidden=m.hidden, num_layers=m.num_layers,
                             num_heads=m.num_heads, ffn_hidden=m.ffn_hidden))


def run(cfg: Config) -> int:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from dcparallel.api import DataCentricParallel
    from dcparallel.demo import SyntheticText, builtin_lengths, lm_micro_batch
    from dcparallel.profile.profiler import ProfilerConfig
    from dcparallel.runtime import comm
    from dcparallel.runtime.launch import init_distributed
    from dcparallel.scenarios import read_lengths
    from dcparallel.sim.replay import replay_step

    if cfg.model.kind != "llama":
        raise ValueError("`dcparallel train` trains the text model for now; see examples/video_dit.py for video")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    launch = init_distributed(timeout=timedelta(seconds=120))  # NCCL + cuda:LOCAL_RANK, or gloo
    cuda = launch.device.type == "cuda"
    rank = comm.world_rank()
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = cfg.train
    if cfg.data.lengths == "builtin":
        lengths = builtin_lengths(cfg.data.num_samples, t.seed)
    else:
        lengths = [int(x) for x in read_lengths(cfg.data.lengths)]
    dataset = SyntheticText(lengths, vocab=cfg.model.vocab_size, seed=t.seed)

    model = _build(cfg).to(launch.device)
    dc = DataCentricParallel(model, layers=model.layers, policy=t.policy, seed=t.seed,
                             memory_bytes=t.memory_mib * 2**20 or None)
    pc = cfg.profile
    config = ProfilerConfig(repeats=pc.repeats, max_mbs=pc.max_mbs, max_tokens=pc.max_tokens,
                            memory_limit=dc.memory_bytes, progress=rank == 0)
    loader = dc.prepare(dataset, lengths=lengths, tokens_per_step=t.tokens_per_step,
                        profile_path=out / "profile.json", profiler_config=config)
    opt = dc.optimizer(lr=t.lr)

    ckpt = out / "checkpoint" / f"rank{rank}.pt"
    done, start_epoch = 0, 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        done, start_epoch = state["steps_done"], state["loader"]["epoch"]
        if rank == 0:
            log.warning("resumed from %s at step %d", ckpt.parent, done)
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None
    total = sum(len(loader.steps(e)) for e in range(start_epoch, t.epochs)) - loader.state_dict()["step"]
    if t.max_steps:
        total = min(total, max(0, t.max_steps - done))
    bar = tqdm(total=total, desc=f"train {t.policy}", file=sys.stderr, disable=rank != 0)
    for epoch in range(start_epoch, t.epochs):
        loader.set_epoch(epoch)
        dc.set_epoch(epoch)
        for step in loader:
            if t.max_steps and done >= t.max_steps:
                break
            t0 = time.perf_counter()
            if cuda:
                torch.cuda.reset_peak_memory_stats(launch.device)
            busy = 0.0
            for batch in step:
                a = time.perf_counter()
                lm_micro_batch(dc, model, batch)
                busy += time.perf_counter() - a
            loss = dc.sync_gradients()
            opt.step()
            done += 1
            step_s = time.perf_counter() - t0
            busys = comm.all_gather_object(busy)
            # the plan is the same on every rank: its largest micro-batch is the planned peak
            peak = max((loader.context.mb_memory(mb.sample_ids, mb.layout) for mb in step.plan.micro_batches()),
                       default=0.0)
            record = {"epoch": epoch, "step": step.index, "global_step": done, "loss": loss,
                      "tokens": step.num_tokens, "tokens_per_s": step.num_tokens / step_s, "step_s": step_s,
                      "idle_fraction": 1 - min(busys) / max(busys) if max(busys) > 0 else 0.0,
                      "planned_peak_memory_bytes": peak,
                      "planned_compute_s": replay_step(step.plan, loader.context).compute_time,
                      "measured_peak_memory_bytes": torch.cuda.max_memory_allocated(launch.device) if cuda else None,
                      "sp_degrees": sorted({g.sp for g in step.plan.groups if g.micro_batches}),
                      "policy": t.policy}
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                bar.update(1)
                bar.write(f"step {done:4d}  loss {loss:.4f}  {record['tokens_per_s']:8.0f} tok/s  "
                          f"{step_s * 1e3:7.0f} ms  idle {100 * record['idle_fraction']:4.1f}%  "
                          f"peak {record['planned_peak_memory_bytes'] / 2**20:6.1f} MiB  sp {record['sp_degrees']}")
            if t.checkpoint_every and done % t.checkpoint_every == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "loader": loader.state_dict(), "steps_done": done}, ckpt)
        if t.max_steps and done >= t.max_steps:
            break
    bar.close()
    if metrics is not None:
        metrics.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
