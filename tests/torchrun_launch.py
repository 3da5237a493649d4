"""A torchrun launch of this checkout and the TOML of a `dcparallel train` run, for the e2e
tests: no torch in this module, so a test module that only writes a config and launches does
not import torch into the pytest process (about 3 processor seconds; `tests.support` and
`tests.train_fixtures` re-export these for the tests that need both).

Several `dcparallel train` runs in one launch (`train_each`): each rank runs this module as a
script (``torchrun_train_each``), which sets up the process group once and runs the CLI's
own entry on each config in turn, then optionally one more `dcparallel` command (such as
`dcparallel profile`, which ends the process group), so the runs pay one launch and one set
of imports (torch's, about 3 processor seconds a process) instead of one each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """``args`` (``["-m", module, ...]`` or a script and its arguments) under
    ``torch.distributed.run --standalone`` on 2 processes, run in ``cwd`` with one thread per
    rank, the hub offline, this checkout on the path and ``env`` added; output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun_train(config: Path, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`dcparallel train --config` ``config`` under `torchrun`."""
    return torchrun(["-m", "dcparallel", "train", "--config", str(config)], cwd, timeout, **env)


def torchrun_train_each(
    configs: list[Path], cwd: Path, timeout: float = 600, then: list[str] = (), **env: str
) -> subprocess.CompletedProcess:
    """`dcparallel train --config` on each of ``configs`` in turn, then the `dcparallel`
    command line ``then`` where given, in one `torchrun` launch (`train_each`)."""
    return torchrun(
        ["-m", "tests.torchrun_launch", *map(str, configs), *(["--", *then] if then else [])], cwd, timeout, **env
    )


def run_stderr(stderr: str, configs: list[Path]) -> list[str]:
    """A `torchrun_train_each` launch's stderr cut into each run's part (`RUN_DONE` lines end them)."""
    parts = stderr.split(RUN_DONE)
    return [parts[i] if i < len(parts) else "" for i in range(len(configs))]


#: the line rank 0 writes on stderr once every rank has finished a run of `train_each`
RUN_DONE = "[train_each] every rank finished the run\n"


def train_each(argv: list[str]) -> int:
    """Under torchrun, ``argv`` = ``CONFIG... [-- COMMAND...]``: the process group set up once,
    then `dcparallel train --config` on each config in turn (`dcparallel train` leaves a
    process group it did not create in place), each run's exit status (or traceback) in
    ``train_status_rank<RANK>`` beside its config and `RUN_DONE` on rank 0's stderr once both
    ranks are past the run; then the `dcparallel` COMMAND, its status in
    ``then_status_rank<RANK>`` in the working directory. 0 when everything succeeded."""
    import torch.distributed as dist

    from dcparallel.runtime.launch import end_distributed, init_distributed

    cut = argv.index("--") if "--" in argv else len(argv)
    configs, then = argv[:cut], argv[cut + 1 :]
    init_distributed()
    failed = 0
    for config in configs:
        failed += _status(["train", "--config", config], Path(config).parent / "train_status") != "0"
        dist.barrier()  # both ranks' output of this run is written before the line that ends it
        if dist.get_rank() == 0:
            print(RUN_DONE, end="", file=sys.stderr, flush=True)
    if then:
        failed += _status(then, Path("then_status")) != "0"
    end_distributed()  # nothing left to end where the command ended the group
    return int(failed > 0)


def _status(argv: list[str], stem: Path) -> str:
    """`dcparallel` ``argv`` on this rank: its exit status, or its traceback (also on stderr),
    written to ``<stem>_rank<RANK>``."""
    from dcparallel.apps.cli import main

    try:
        status = str(main(argv))
    except Exception:  # noqa: BLE001 - written for the run's test; the other runs still go on
        status = traceback.format_exc()
        print(status, file=sys.stderr, flush=True)
    stem.with_name(f"{stem.name}_rank{os.environ['RANK']}").write_text(status)
    return status


def write_config(path: Path, **sections: dict) -> Path:
    """A `dcparallel train` TOML at ``path``: one table per section, its keys in order
    (strings and paths quoted, booleans lower case, numbers as Python writes them)."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(str(v)) if isinstance(v, (str, Path)) else repr(v)

    path.write_text(
        "".join(
            f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items()) for name, keys in sections.items()
        )
    )
    return path


if __name__ == "__main__":
    raise SystemExit(train_each(sys.argv[1:]))
