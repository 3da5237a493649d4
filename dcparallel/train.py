"""`dcparallel train --config FILE.toml`: train a reference model under torchrun.

    torchrun --standalone --nproc-per-node 2 -m dcparallel.cli train --config run.toml
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m dcparallel.cli train --config run.toml

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

Config (every key optional; defaults below)::

    [model]
    family = "reference"    # "reference" (dcparallel's Llama), "transformers" or "diffusers"
    kind = "llama"          # reference family: "llama" (text)
    hidden = 128            # reference family: must be a multiple of num_heads
    num_layers = 4          # >= 1
    num_heads = 4
    ffn_hidden = 352
    vocab_size = 256
    architecture = ""       # transformers: a *ForCausalLM class, e.g. "Qwen3ForCausalLM";
                            # diffusers: "WanTransformer3DModel"
    [model.config]          # transformers / diffusers: the config's / constructor's fields, e.g.
                            # hidden_size = 128, num_attention_heads = 8, num_key_value_heads = 2

    [data]
    lengths = "builtin"     # or a file: one token count a line (diffusers: latent "frames height
                            # width" a line), or a .npy array
    num_samples = 200       # builtin: how many samples
    text_tokens = 16        # diffusers: caption embedding tokens per synthetic sample

    [train]
    policy = "dcp"
    tokens_per_step = 8192
    epochs = 1
    max_steps = 0           # 0: no limit
    lr = 0.003
    seed = 0
    memory_mib = 0          # per-rank budget; 0: the device's memory
    out_dir = "runs/train"
    checkpoint_every = 0    # 0: only at the end of the run
    keep_checkpoints = 2    # committed checkpoints kept (the newest first)
    nan_policy = "stop"     # a non-finite step loss: "stop" (error) or "skip" (no update, reported)
    resume_anyway = false   # resume a checkpoint written under another config
    step_timeout_s = 0      # watchdog: a step longer than this dumps every thread and exits (0: off)
    pg_timeout_s = 120      # process-group timeout: a collective waiting longer fails

    [profile]               # how much the profiler measures
    cost = "profiled"       # or "analytic": plan from the analytic cost model, no profiling
    path = ""               # the profile cache; "": out_dir/profile.json (one copy per world size)
    repeats = 3             # timed runs per layout (median)
    max_mbs = 16            # micro-batch sizes doubled up to this
    max_tokens = 4096       # ... or up to this many tokens

Fault injection (tests, the reliability report): ``DCPARALLEL_FAULT="KIND@STEP:RANK[:ATTEMPT],..."``
makes rank RANK, during global step STEP (1-based), of restart ATTEMPT (torchrun's
``TORCHELASTIC_RESTART_COUNT``, default 0) ``exit`` (os._exit(17)), ``raise`` (RuntimeError),
``hang`` (sleep until the watchdog or the process-group timeout ends it) or ``nan`` (its loss
becomes NaN).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
import typing
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import tomllib

log = logging.getLogger("dcparallel.train")

FAULT_ENV = "DCPARALLEL_FAULT"
FAULT_KINDS = ("exit", "raise", "hang", "nan")
POLICY_NAMES = ("bucket", "packed", "dcp-intra", "dcp-inter", "dcp-inter-pac", "dcp")


def _opt(default: Any, *, lo: float | None = None, gt: float | None = None, choices: tuple = (),
         resume: bool = True) -> Any:
    """A config field: ``lo`` (>=), ``gt`` (>), ``choices``; ``resume``: a checkpoint written
    with another value is refused (False: the field may change between launches)."""
    return field(default=default, metadata={"lo": lo, "gt": gt, "choices": choices, "resume": resume})


@dataclass(kw_only=True)
class ModelConfig:
    """The model to build (`_build`): dcparallel's reference LM, or a transformers / diffusers
    class built from ``config`` (never downloaded)."""

    family: str = _opt("reference", choices=("reference", "transformers", "diffusers"))
    architecture: str = _opt("")
    config: dict = field(default_factory=dict)
    kind: str = _opt("llama", choices=("llama", "dit"))
    hidden: int = _opt(128, lo=1)
    num_layers: int = _opt(4, lo=1)
    num_heads: int = _opt(4, lo=1)
    ffn_hidden: int = _opt(352, lo=1)
    vocab_size: int = _opt(256, lo=2)

    def check(self, where: str) -> None:
        if not isinstance(self.config, dict):
            raise ValueError(f"{where}: [model.config] must be a table of the model's config fields")
        if self.family != "reference":
            if not self.architecture:
                example = "LlamaForCausalLM" if self.family == "transformers" else "WanTransformer3DModel"
                raise ValueError(f'{where}: [model] family = {self.family!r} needs architecture, e.g. "{example}"')
            return
        if self.hidden % self.num_heads:
            raise ValueError(f"{where}: [model] hidden = {self.hidden} is not a multiple of num_heads = "
                             f"{self.num_heads}; pick num_heads dividing hidden (e.g. {_divisor(self.hidden)})")


@dataclass(kw_only=True)
class DataConfig:
    lengths: str = _opt("builtin")
    num_samples: int = _opt(200, lo=1)
    text_tokens: int = _opt(16, lo=1)

    def check(self, where: str) -> None:
        if not self.lengths:
            raise ValueError(f'{where}: [data] lengths is empty; give "builtin" or a lengths file')


@dataclass(kw_only=True)
class TrainConfig:
    policy: str = _opt("dcp", choices=POLICY_NAMES)
    tokens_per_step: int = _opt(8192, lo=1)
    epochs: int = _opt(1, lo=1, resume=False)
    max_steps: int = _opt(0, lo=0, resume=False)
    lr: float = _opt(3e-3, gt=0)
    seed: int = _opt(0, lo=0)
    memory_mib: int = _opt(0, lo=0)
    out_dir: str = _opt("runs/train", resume=False)
    checkpoint_every: int = _opt(0, lo=0, resume=False)
    keep_checkpoints: int = _opt(2, lo=1, resume=False)
    nan_policy: str = _opt("stop", choices=("stop", "skip"))
    resume_anyway: bool = _opt(False, resume=False)
    step_timeout_s: float = _opt(0.0, lo=0, resume=False)
    pg_timeout_s: float = _opt(120.0, gt=0, resume=False)

    def check(self, where: str) -> None:
        if not self.out_dir:
            raise ValueError(f"{where}: [train] out_dir is empty; give a folder for metrics and checkpoints")


@dataclass(kw_only=True)
class ProfileConfig:
    cost: str = _opt("profiled", choices=("profiled", "analytic"))
    path: str = _opt("", resume=False)
    repeats: int = _opt(3, lo=1, resume=False)
    max_mbs: int = _opt(16, lo=1, resume=False)
    max_tokens: int = _opt(4096, lo=1, resume=False)

    def check(self, where: str) -> None:
        pass


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "profile": ProfileConfig}


def _divisor(n: int) -> int:
    return next(k for k in (8, 4, 2, 1) if n % k == 0)


def _check_value(where: str, section: str, f: dataclasses.Field, kind: type, value: Any) -> Any:
    """``value`` as the field's type, or ValueError naming the key, the value and the fix."""
    key = f"[{section}] {f.name} = {value!r}"
    if kind is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {key} must be a table ([{section}.{f.name}]), not {_tname(value)}")
        return value
    example = f"e.g. {f.name} = {json.dumps(f.default)}"
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false ({example})")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {key} must be an integer, not {_tname(value)} ({example})")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key} must be a number, not {_tname(value)} ({example})")
        if not math.isfinite(value):
            raise ValueError(f"{where}: {key} must be a finite number ({example})")
        value = float(value)
    elif kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: {key} must be a string in quotes, not {_tname(value)} ({example})")
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise ValueError(f"{where}: {key} is not one of {', '.join(map(repr, m['choices']))}")
    if m.get("lo") is not None and value < m["lo"]:
        raise ValueError(f"{where}: {key} must be >= {m['lo']} ({example})")
    if m.get("gt") is not None and not value > m["gt"]:
        raise ValueError(f"{where}: {key} must be > {m['gt']} ({example})")
    return value


def _tname(value: Any) -> str:
    names = {str: "a string", bool: "a boolean", list: "a list", dict: "a table", float: "a fraction"}
    return names.get(type(value), type(value).__name__)


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
        return Config.from_dict(raw, str(p))

    @staticmethod
    def from_dict(raw: dict, where: str = "config") -> Config:
        """A validated config from a dict of sections (as TOML gives it)."""
        raw = dict(raw)
        unknown = sorted(set(raw) - set(SECTIONS))
        if unknown:
            raise ValueError(f"{where}: unknown section(s) {unknown}; use {', '.join(f'[{s}]' for s in SECTIONS)}")
        out = Config()
        for section, cls in SECTIONS.items():
            values = raw.get(section, {})
            if not isinstance(values, dict):
                raise ValueError(f"{where}: {section} must be a [{section}] table, not {_tname(values)}")
            known = {f.name for f in fields(cls)}
            bad = sorted(set(values) - known)
            if bad:
                hint = "; ".join(f"{b!r}: did you mean {m!r}?" for b in bad if (m := _closest(b, known)))
                raise ValueError(f"{where}: unknown key(s) {bad} in [{section}]; known: {sorted(known)}"
                                 + (f" ({hint})" if hint else ""))
            setattr(out, section, cls(**values))
        out.validate(where)
        return out

    def validate(self, where: str = "config") -> None:
        """Types and ranges of every field, then the checks across fields."""
        for section, cls in SECTIONS.items():
            obj = getattr(self, section)
            hints = typing.get_type_hints(cls)
            for f in fields(cls):
                setattr(obj, f.name, _check_value(where, section, f, hints[f.name], getattr(obj, f.name)))
            obj.check(where)
        if self.model.family == "reference" and self.model.kind != "llama":
            raise ValueError(f"{where}: `dcparallel train` trains the text model (kind = 'llama') for now; "
                             f"see examples/video_dit.py for video")

    def resume_key(self) -> dict[str, Any]:
        """The settings a checkpoint must have been written under to be resumed."""
        return {f"{s}.{f.name}": getattr(getattr(self, s), f.name)
                for s, cls in SECTIONS.items() for f in fields(cls) if f.metadata.get("resume", True)}


def _closest(name: str, known: set[str]) -> str | None:
    import difflib

    m = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return m[0] if m else None


def _build(cfg: Config):
    """The model of ``[model]``, on the CPU, seeded by the run's seed."""
    import torch

    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    if m.family == "transformers":
        import transformers

        model_cls = getattr(transformers, m.architecture, None)
        config_cls = getattr(transformers, m.architecture.replace("ForCausalLM", "Config"), None)
        if model_cls is None or config_cls is None or not m.architecture.endswith("ForCausalLM"):
            raise ValueError(f"[model] architecture = {m.architecture!r} is not a transformers *ForCausalLM class "
                             f"with a matching *Config (e.g. LlamaForCausalLM, Qwen3ForCausalLM, MistralForCausalLM)")
        return model_cls._from_config(config_cls(**m.config), attn_implementation="sdpa").float()
    if m.family == "diffusers":
        import diffusers

        model_cls = getattr(diffusers, m.architecture, None)
        if model_cls is None:
            raise ValueError(f"[model] architecture = {m.architecture!r} is not a diffusers class "
                             f"(e.g. WanTransformer3DModel)")
        return model_cls(**m.config).float()
    from dcparallel.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=m.vocab_size, hidden=m.hidden, num_layers=m.num_layers,
                             num_heads=m.num_heads, ffn_hidden=m.ffn_hidden))


def _dataset(cfg: Config, model, lengths: list):
    """Synthetic samples of the given sizes for the model's family."""
    from dcparallel.data.synthetic import SyntheticLatents, SyntheticText

    if cfg.model.family == "diffusers":
        c = model.config
        return SyntheticLatents(lengths, channels=c.in_channels, text_dim=c.text_dim,
                                text_tokens=cfg.data.text_tokens, seed=cfg.train.seed)
    vocab = model.config.vocab_size if cfg.model.family == "transformers" else cfg.model.vocab_size
    return SyntheticText(lengths, vocab=vocab, seed=cfg.train.seed)


# ---------------------------------------------------------------- faults and watchdog


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    attempt: int = 0


def parse_faults(spec: str) -> list[Fault]:
    """``"exit@3:1,hang@5:0:1"`` -> faults; ValueError naming the bad item and the format."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            kind, rest = item.split("@")
            nums = [int(x) for x in rest.split(":")]
            if kind not in FAULT_KINDS or len(nums) not in (2, 3) or min(nums) < 0 or nums[0] < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: bad item {item!r}; write KIND@STEP:RANK[:ATTEMPT] with KIND one of "
                             f"{', '.join(FAULT_KINDS)}, STEP >= 1 (global, 1-based), e.g. exit@3:1") from None
        out.append(Fault(kind, *nums))
    return out


def _attempt() -> int:
    from dcparallel.runtime.launch import restart_attempt

    return restart_attempt()


def _fire(fault: Fault, events: Path | None) -> bool:
    """Carries out a fault; True for "nan" (the caller poisons the loss)."""
    _event(events, {"event": "fault", "kind": fault.kind, "step": fault.step, "rank": fault.rank,
                    "attempt": fault.attempt})
    log.error("injected fault: %s at step %d on rank %d (attempt %d)", fault.kind, fault.step, fault.rank,
              fault.attempt)
    if fault.kind == "exit":
        sys.stderr.flush()
        os._exit(17)
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault: raise at step {fault.step} on rank {fault.rank}")
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    return True


def _event(path: Path | None, record: dict) -> None:
    """Appends one event line (rank 0 writes them; a faulting rank writes its fault)."""
    if path is None:
        return
    with open(path, "a") as f:
        f.write(json.dumps({**record, "time": time.time()}) + "\n")


# ---------------------------------------------------------------- inputs


#: the builtin latent shapes (frames, height, width) of a diffusers video run
BUILTIN_LATENTS = ((1, 8, 8), (1, 8, 12), (2, 8, 8), (3, 8, 12), (3, 12, 8), (5, 12, 16))


def read_train_lengths(cfg: Config) -> list:
    from dcparallel.data.synthetic import builtin_lengths
    from dcparallel.scenarios import read_lengths

    video_model = cfg.model.family == "diffusers"
    if cfg.data.lengths == "builtin":
        if video_model:
            return [BUILTIN_LATENTS[(i * 7) % len(BUILTIN_LATENTS)] for i in range(cfg.data.num_samples)]
        return builtin_lengths(cfg.data.num_samples, cfg.train.seed)
    sizes = read_lengths(cfg.data.lengths)
    wrong = next((i for i, s in enumerate(sizes) if isinstance(s, tuple) != video_model), None)
    if wrong is not None:
        want = "a latent shape 'frames height width'" if video_model else "one token count"
        raise ValueError(f"{cfg.data.lengths}: sample {wrong} is {sizes[wrong]!r}; this model takes {want} a line")
    return [tuple(int(v) for v in x) if video_model else int(x) for x in sizes]


def check_fits(spec, lengths, world_size: int, gpus_per_node: int, memory_bytes: int) -> None:
    """Raises the planner's `NoLayoutFits` (the message `simulate` prints) up front, before
    any profiling, when a sample fits no layout by the analytic cost model: the profiler
    would otherwise try to run it and die on a raw allocator error. The analytic model
    estimates memory from calibrated constants, so this catches samples far beyond memory;
    the profile decides the rest."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.plan.context import PlanContext
    from dcparallel.spec import ClusterSpec, Workload

    cluster = ClusterSpec(world_size=world_size, gpus_per_node=gpus_per_node, memory_bytes=int(memory_bytes),
                          intra_bw=1e10, inter_bw=1e10, name="up-front check")
    PlanContext(Workload(spec, tuple(lengths)), AnalyticCost(spec, cluster), cluster)


def _loader(cfg: Config, dc, dataset, lengths: list[int], out: Path, rank: int):
    from dcparallel.profile.profiler import ProfilerConfig

    t, pc = cfg.train, cfg.profile
    if pc.cost == "analytic":
        from dcparallel.cost.analytic import AnalyticCost
        from dcparallel.data.loader import DataCentricLoader, check_step_budget

        check_step_budget(t.tokens_per_step, None)
        cluster = dataclasses.replace(dc.cluster_spec, intra_bw=dc.cluster_spec.intra_bw or 1e10,
                                      inter_bw=dc.cluster_spec.inter_bw or 1e10)
        dc.cost = AnalyticCost(dc.spec, cluster)
        dc.loader = DataCentricLoader(dataset, lengths, cost=dc.cost, cluster=dc.cluster_spec, policy=t.policy,
                                      tokens_per_step=t.tokens_per_step, seed=t.seed, collate=dc.adapter.collate,
                                      device=dc.params[0].device)  # the adapter's collate, as prepare uses
        return dc.loader
    check_fits(dc.spec, lengths, dc.cluster_spec.world_size, dc.cluster_spec.gpus_per_node, dc.memory_bytes)
    config = ProfilerConfig.quick(pc.max_tokens, repeats=pc.repeats, max_mbs=pc.max_mbs,
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

    from dcparallel import checkpoint
    from dcparallel.api import DataCentricParallel
    from dcparallel.runtime import comm
    from dcparallel.runtime.launch import init_distributed
    from dcparallel.sim.replay import replay_step

    t = cfg.train
    rank, world = comm.world_rank(), comm.world_size()
    attempt = _attempt()
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
    model = _build(cfg).to(launch.device)
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
            _event(events, {"event": "resume", "step": done, "replayed": replayed, "from_world_size": ck.world_size,
                            "world_size": world, "attempt": attempt})
    if rank == 0:
        _event(events, {"event": "start", "step": done, "world_size": world, "attempt": attempt})

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
                if fault is not None and _fire(fault, fault_log):
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
                        _event(events, {"event": "skip", "step": done + 1, "loss": str(loss)})
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
                          "sp_degrees": sorted({g.sp for g in step.plan.groups if g.micro_batches}),
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
        _event(events, {"event": "finish", "step": done, "world_size": world})
    return 0
