"""One other interpreter whose string hashing differs from this test process's, for the tests
that ranks plan alike: each rank is a process with its own hash seed, so a planner that
iterates a set or dict of strings in hash order would plan differently on each. The test
process computes its own answer; one child with another seed (checked: its hash of a probe
string differs from ours) computes the same, and the two must agree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "dcparallel hash probe"


def other_hash_seed() -> str:
    """A PYTHONHASHSEED other than this process's (a fixed one differs from a random one)."""
    return "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"


def run_with_other_hash_seed(code: str, timeout: float = 300) -> str:
    """The last line ``python -c code`` prints, run from the repository root in an interpreter
    whose ``hash`` of strings differs from this process's (asserted, not assumed)."""
    env = dict(os.environ, PYTHONHASHSEED=other_hash_seed(), PYTHONPATH=str(ROOT))
    probe = f"print(hash({PROBE!r}), flush=True)\n"
    r = subprocess.run(
        [sys.executable, "-c", probe + code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert int(lines[0]) != hash(PROBE), "the child hashes strings as this process does: the test proves nothing"
    return lines[-1]
