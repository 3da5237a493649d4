"""Where `dcparallel train` puts its per-step metrics (rank 0 only): ``out_dir/metrics.jsonl``,
a progress bar with one line per step, and, when ``[log]`` asks, TensorBoard event files in
``out_dir/tb`` and a Weights & Biases run (offline by default: it writes under
``out_dir/wandb`` and needs no network; ``wandb sync`` uploads it later).

Each step's record has: loss, tokens/s, step time, idle fraction, planned and measured peak
memory, SP degrees, learning rate, gradient norm (pre-clip), and on eval steps the eval loss;
the dashboards get the numeric ones under ``train/``, ``eval/``, ``memory/``, ``plan/``.
Events (start, resume, skipped step, finish; a ``before_step`` hook may add its own) go to
``out_dir/events.jsonl`` (`append_event`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

#: record key -> dashboard tag
SCALARS = {
    "loss": "train/loss",
    "tokens_per_s": "train/tokens_per_s",
    "step_s": "train/step_s",
    "idle_fraction": "train/idle_fraction",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "eval_loss": "eval/loss",
    "planned_peak_memory_bytes": "memory/planned_peak_bytes",
    "measured_peak_memory_bytes": "memory/measured_peak_bytes",
    "measured_peak_reserved_bytes": "memory/measured_peak_reserved_bytes",
    "device_free_bytes": "memory/device_free_bytes",
    "sp_max": "plan/sp_max",
    "sp_mean": "plan/sp_mean",
}


class MetricsSinks:
    """The metrics outputs of one run on rank 0 (on other ranks every method does nothing).
    ``done``: steps already trained (a resumed run drops dashboard events after it)."""

    def __init__(self, cfg: Any, out: Path, rank: int, done: int, total: int):
        from tqdm import tqdm

        self.active = rank == 0
        self.jsonl = open(out / "metrics.jsonl", "a") if self.active else None
        self.bar = tqdm(total=total, desc=f"train {cfg.train.policy}", file=sys.stderr, disable=not self.active)
        self.tb = self.wandb = None
        if self.active and cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"), purge_step=done + 1 if done else None)
        if self.active and cfg.log.wandb:
            import wandb

            (out / "wandb").mkdir(exist_ok=True)
            self.wandb = wandb.init(
                project=cfg.log.wandb_project,
                mode=cfg.log.wandb_mode,
                dir=str(out),
                config={s: vars(getattr(cfg, s)) for s in ("model", "data", "train")},
                resume="allow",
                id=_run_id(out),
            )

    def write(self, record: dict) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        step = record["global_step"]
        sp = record.get("sp_degrees") or []
        values = {**record, "sp_max": max(sp, default=None), "sp_mean": sum(sp) / len(sp) if sp else None}
        numeric = {tag: float(values[k]) for k, tag in SCALARS.items() if isinstance(values.get(k), (int, float))}
        if self.tb is not None:
            for tag, v in numeric.items():
                self.tb.add_scalar(tag, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        self.bar.update(1)
        loss = record["loss"]
        extra = f"  eval {record['eval_loss']:.4f}" if record.get("eval_loss") is not None else ""
        self.bar.write(
            f"step {step:4d}  loss {loss if loss is None else f'{loss:.4f}'}  "
            f"{record['tokens_per_s']:8.0f} tok/s  {record['step_s'] * 1e3:7.0f} ms  "
            f"idle {100 * record['idle_fraction']:4.1f}%  peak "
            f"{record['planned_peak_memory_bytes'] / 2**20:6.1f} MiB  sp {record['sp_degrees']}  "
            f"lr {record['lr']:.2e}  |g| {record['grad_norm']:.3g}{extra}"
        )

    def close(self) -> None:
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _run_id(out: Path) -> str:
    """One W&B run id per out_dir, kept in out_dir/wandb/run_id (a resumed run continues it)."""
    import uuid

    f = out / "wandb" / "run_id"
    if not f.exists():
        f.write_text(uuid.uuid4().hex[:12])
    return f.read_text().strip()


def append_event(path: Path | None, record: dict) -> None:
    """Appends one event line, stamped with the time (rank 0 writes them; None: nothing)."""
    if path is None:
        return
    with open(path, "a") as f:
        f.write(json.dumps({**record, "time": time.time()}) + "\n")


def trim_metrics(path: Path, done: int) -> int:
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
