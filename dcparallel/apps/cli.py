"""`dcparallel` command line: simulate | plan | profile | train | export | convert-checkpoint | demo.

Machine-readable output (`--json`) is one JSON object on one line, last on stdout;
progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from dcparallel.apps import demo, simulate
from dcparallel.plan.policies import ALL, COMPARED, NAMES, POLICIES


def _train(path: Path, resume_anyway: bool = False, check: bool = False) -> int:
    from dcparallel.apps.train_config import Config

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    cfg = Config.load(path)
    cfg.train.resume_anyway = cfg.train.resume_anyway or resume_anyway
    if check:  # no torchrun, no torch: what can be checked before the workers start
        from dcparallel.apps.train_inputs import check_config

        print(check_config(cfg, str(path)), flush=True)
        return 0
    from dcparallel.apps.train import run

    return run(cfg)


def _export(path: Path, out: Path | None, step: int | None) -> int:
    from dcparallel.apps.train_export import export_run

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    print(export_run(path, out, step))
    return 0


def _convert(path: Path) -> int:
    from dcparallel.apps.train_export import convert_run

    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    print(f"converted steps {convert_run(path)}")
    return 0


def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train or fine-tune a model (a local transformers / diffusers model "
        "directory, or the reference model) from a TOML config, under torchrun",
    )
    p.add_argument(
        "--config",
        required=True,
        type=Path,
        help="TOML file: [model], [data], [train], [profile], [log] (docs/training.md)",
    )
    p.add_argument(
        "--resume-anyway",
        action="store_true",
        help="resume a checkpoint written under another config (the differences are logged)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the config, its files and lengths in this process and exit; run it without "
        "torchrun, before launching",
    )
    p.set_defaults(func=lambda a: _train(a.config, a.resume_anyway, a.check))


def _add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="a run's committed checkpoint as a model directory (save_pretrained), without training"
    )
    p.add_argument("--config", required=True, type=Path, help="the run's TOML file (its out_dir holds the checkpoints)")
    p.add_argument("--out", type=Path, default=None, help="the directory to write (default: out_dir/export/step_N)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest committed)")
    p.set_defaults(func=lambda a: _export(a.config, a.out, a.step))


def _add_convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert-checkpoint", help="a run's per-rank checkpoints of dcparallel 0.1 rewritten in place in the one format"
    )
    p.add_argument("--config", required=True, type=Path, help="the run's TOML file (its out_dir holds the checkpoints)")
    p.set_defaults(func=lambda a: _convert(a.config))


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the subcommand asked for: `profile`'s arguments (its presets) need torch, which
    # `simulate` and `plan` never import; they are built only when they can be used
    cmd = next((a for a in argv if not a.startswith("-")), None)
    ap = argparse.ArgumentParser(prog="dcparallel", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("simulate", help="plan an epoch with each policy and simulate it")
    simulate.add_workload_arguments(p)
    p.add_argument("--policy", action="append", choices=NAMES, help="policy, a user or a research one (repeatable)")
    p.add_argument(
        "--all",
        action="store_true",
        help=f"the research ablations too ({', '.join(n for n in ALL if n not in POLICIES)}); "
        f"default: {', '.join(COMPARED)}",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on one line")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--max-steps", type=int, default=None, help="plan and simulate only the epoch's first N steps")
    p.set_defaults(func=simulate.cmd_simulate)

    p = sub.add_parser("plan", help="print the step plans a policy makes")
    simulate.add_workload_arguments(p)
    p.add_argument("--policy", choices=NAMES, default="dcp", help="a user or a research policy (default: dcp)")
    p.add_argument("--steps", type=int, default=3, help="how many steps to print (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object per step, one per line")
    p.set_defaults(func=simulate.cmd_plan)

    p = sub.add_parser("profile", help="measure a model on this device (two layers, extrapolated)")
    if cmd in (None, "profile"):
        from dcparallel.apps import profile

        profile.add_arguments(p)
        p.set_defaults(func=profile.cmd_profile)

    _add_train_parser(sub)
    _add_export_parser(sub)
    _add_convert_parser(sub)

    p = sub.add_parser("demo", help="the main job: real 2-rank training per policy, predicted and reported")
    demo.add_arguments(p)
    p.set_defaults(func=demo.cmd_demo)

    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # one write, newline included: two ranks' errors do not run together
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        return 2


if __name__ == "__main__":
    sys.exit(main())
