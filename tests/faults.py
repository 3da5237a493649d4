"""Fault injection into `dcparallel train` runs (the reliability tests and
benchmarks/reliability.py): a ``before_step`` hook built from an environment variable.

``DCPARALLEL_FAULT="KIND@STEP:RANK[:ATTEMPT],..."`` makes rank RANK, during global step STEP
(1-based), of restart ATTEMPT (torchrun's ``TORCHELASTIC_RESTART_COUNT``, default 0) ``exit``
(os._exit(17)), ``raise`` (RuntimeError), ``hang`` (sleep until the watchdog or the
process-group timeout ends it) or ``nan`` (its loss becomes NaN).

In-process: `run(cfg)` is `dcparallel.apps.train.run` with the faults of the variable. Under
torchrun, as `dcparallel train --config FILE` with them (the repository root on PYTHONPATH)::

    DCPARALLEL_FAULT=exit@3:1 torchrun --nproc-per-node 2 --max-restarts 1 -m tests.faults --config run.toml

``--reference ref.toml`` first trains ``ref.toml``'s run with no faults, in the same launch
(on a restart it finds that run finished and goes on to the faulted one): the uninterrupted
run a faulted one is compared with, without a launch of its own.

`run_config` writes the small run these faults are injected into, `launch` runs it so. The
pytest process imports this module without torch (dcparallel's trainer is imported where a
rank runs).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.torchrun_launch import write_config

if TYPE_CHECKING:
    from dcparallel.apps.train_config import Config
    from dcparallel.apps.trainer import StepHook, Trainer

log = logging.getLogger("dcparallel.train")

FAULT_ENV = "DCPARALLEL_FAULT"
FAULT_KINDS = ("exit", "raise", "hang", "nan")


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
            raise ValueError(
                f"{FAULT_ENV}: bad item {item!r}; write KIND@STEP:RANK[:ATTEMPT] with KIND one of "
                f"{', '.join(FAULT_KINDS)}, STEP >= 1 (global, 1-based), e.g. exit@3:1"
            ) from None
        out.append(Fault(kind, *nums))
    return out


def fire(fault: Fault, trainer: Trainer) -> None:
    """Carries out a fault on this rank, after writing its event (every rank may write one)."""
    from dcparallel.apps.train_log import append_event

    append_event(
        trainer.out / "events.jsonl",
        {"event": "fault", "kind": fault.kind, "step": fault.step, "rank": fault.rank, "attempt": fault.attempt},
    )
    log.error(
        "injected fault: %s at step %d on rank %d (attempt %d)", fault.kind, fault.step, fault.rank, fault.attempt
    )
    if fault.kind == "exit":
        sys.stderr.flush()
        os._exit(17)
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault: raise at step {fault.step} on rank {fault.rank}")
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    # "nan": a NaN in this rank's summed loss and gradient, as an overflow would leave; put in
    # before the step's backward (the overlapped sync may send them during it)
    dc = trainer.dc
    dc.zero_grad()
    dc.flat_grad[0] += float("nan")
    dc.grad_sync.stats[0] += float("nan")


def fault_hook(faults: list[Fault]) -> StepHook | None:
    """The ``before_step`` hook that fires each fault at its step, rank and restart attempt;
    None without faults."""
    if not faults:
        return None
    by_key = {(f.step, f.rank, f.attempt): f for f in faults}

    def before_step(trainer: Trainer, step: int) -> None:
        fault = by_key.get((step, trainer.rank, trainer.attempt))
        if fault is not None:
            fire(fault, trainer)

    return before_step


def run(cfg: Config) -> int:
    """`dcparallel.apps.train.run` with the faults of ``DCPARALLEL_FAULT`` (checked first)."""
    from dcparallel.apps import train

    return train.run(cfg, before_step=fault_hook(parse_faults(os.environ.get(FAULT_ENV, ""))))


def run_after(reference: Config, cfg: Config) -> int:
    """``reference``'s run with no faults, then `run` of ``cfg``, on one process group (set up
    here, so both runs use it). A restarted launch finds ``reference`` finished (its last
    checkpoint) and skips it without planning."""
    from dcparallel.apps import train
    from dcparallel.runtime.launch import end_distributed, init_distributed

    hook = fault_hook(parse_faults(os.environ.get(FAULT_ENV, "")))
    init_distributed(timeout=timedelta(seconds=cfg.train.pg_timeout_s))
    code = train.run(reference) or train.run(cfg, before_step=hook)
    end_distributed()
    return code


def run_config(root: Path, name: str, num_samples: int = 36, **train: Any) -> tuple[Path, Path]:
    """A tiny Llama's run for fault injection: ``num_samples`` synthetic lengths (16-215
    tokens), checkpoints every 2 steps, a 6 s step watchdog, a 30 s process-group timeout,
    analytic cost, plus the ``train`` keys given; (the config's path, the run's out_dir)."""
    lengths = root / "lengths.txt"
    lengths.write_text("\n".join(str(16 + (53 * i) % 200) for i in range(num_samples)) + "\n")
    out = root / name
    config = write_config(
        root / f"{name}.toml",
        model={"num_layers": 2, "hidden": 32, "num_heads": 4, "ffn_hidden": 64},
        data={"lengths": lengths},
        train={
            "tokens_per_step": 500,
            "out_dir": out,
            "checkpoint_every": 2,
            "step_timeout_s": 6,
            "pg_timeout_s": 30,
            **train,
        },
        profile={"cost": "analytic"},
    )
    return config, out


def launch(
    config: Path,
    *,
    ranks: int = 2,
    fault: str = "",
    restarts: int = 0,
    cwd: Path | None = None,
    timeout: float = 300,
    reference: Path | None = None,
) -> subprocess.CompletedProcess:
    """``config``'s run under torchrun (``ranks`` processes, ``restarts`` restarts) with the
    faults ``fault`` (a ``DCPARALLEL_FAULT`` value) fired by this module's hook; after
    ``reference``'s run with no faults in the same launch where it is given."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env[FAULT_ENV] = fault
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--max-restarts",
        str(restarts),
        "-m",
        "tests.faults",
        "--config",
        str(config),
        *(["--reference", str(reference)] if reference is not None else []),
    ]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="dcparallel train with the faults of DCPARALLEL_FAULT")
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--reference", type=Path, help="a run trained first, with no faults, in the same launch")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    from dcparallel.apps.train_config import Config

    if args.reference is None:
        return run(Config.load(args.config))
    return run_after(Config.load(args.reference), Config.load(args.config))


if __name__ == "__main__":
    raise SystemExit(main())
