"""A torchrun launch of this checkout and the TOML of a `dcparallel train` run, for the e2e
tests: no torch in this module, so a test module that only writes a config and launches does
not import torch into the pytest process (about 3 processor seconds; `tests.support` and
`tests.train_fixtures` re-export these for the tests that need both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
