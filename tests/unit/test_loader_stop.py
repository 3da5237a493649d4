"""Stopping a loop early (a `break`, an exception) while the planner is busy with a step
the loop will never take: the loop gets on at once, and the planning process (or thread)
does not outlive the stop; a training process that is killed takes its planning process
with it, even in the middle of a plan (else the planner holds the launcher's output pipe
and the run "does not exit" until the plan is done)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dcparallel.plan import policies

from . import _slow_policy
from ._slow_policy import SlowMark
from .test_loader import make, text_data

ROOT = Path(__file__).resolve().parents[2]
PLAN_S = 60.0  # a plan in flight when the loop stops: far longer than any wait below


@pytest.fixture(autouse=True)
def slow_policy(monkeypatch):
    monkeypatch.setitem(policies.RESEARCH, "slow", _slow_policy.SPEC)


def slow_loader(planning: str):
    ds, lens = text_data(60, seed=3)
    ld = make(ds, lens, planning=planning, lookahead=2, policy="slow", research=True)
    ld.context.cost.slow = SlowMark(PLAN_S)  # the planning process imports _slow_policy with it
    return ld


class UserError(Exception):
    pass


@pytest.mark.parametrize("planning,stop", [("process", "break"), ("process", "raise"), ("thread", "break")])
def test_a_loop_that_stops_early_leaves_at_once(planning, stop):
    ld = slow_loader(planning)
    assert len(ld) > 2
    ld.start_planning()
    workers = list(ld._idle_workers)
    t0 = time.perf_counter()
    with pytest.raises(UserError) if stop == "raise" else contextlib.nullcontext():
        for step in ld:
            assert step.index == 0
            time.sleep(1.0)  # the step's work: meanwhile the planner takes on step 1
            t0 = time.perf_counter()
            if stop == "raise":
                raise UserError
            break
    waited = time.perf_counter() - t0
    assert waited < 10, f"the {stop} took {waited:.1f} s: it waited for the plan in flight"
    for w in workers:  # the busy planning process is gone, not left planning
        assert w.proc.wait(timeout=5) is not None
    assert ld._idle_workers == []


def test_close_ends_an_iteration_kept_by_hand_and_the_idle_planners():
    ld = slow_loader("process")
    ld.start_planning()
    (busy,) = ld._idle_workers
    with ld:
        it = iter(ld)
        assert next(it).index == 0
        other = make(*text_data(20, seed=1), planning="process")  # a second loader, left alone
        time.sleep(1.0)  # the planner takes on step 1
        t0 = time.perf_counter()
    assert time.perf_counter() - t0 < 10
    assert busy.proc.wait(timeout=5) is not None and ld._idle_workers == []
    with pytest.raises(StopIteration):
        next(it)  # the iteration is over
    ld.policy = "packed"  # the loader is still usable: a new planning process, the whole epoch
    assert [s.index for s in ld] == list(range(len(ld)))
    (idle,) = ld._idle_workers
    ld.close()
    assert idle.proc.wait(timeout=5) == 0
    assert len(list(other)) == len(other)


SCRIPT = """
import os, sys, time
sys.path[:0] = [{root!r}]
from dcparallel.plan.policies import RESEARCH
from tests.unit._slow_policy import SPEC
from tests.unit.test_loader_stop import slow_loader
RESEARCH["slow"] = SPEC
ld = slow_loader("process")
it = iter(ld)
next(it)
time.sleep(1.0)  # the planner takes on step 1
print("step 0", flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_killed_training_process_takes_its_busy_planning_process_with_it(tmp_path):
    """The planning process shares the training process's stdout (its messages reach the
    launcher's log): once the training process is killed, the pipe closes when the
    planning process ends too, within seconds, not after its plan."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(root=str(ROOT))))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    try:
        out, _ = proc.communicate(timeout=PLAN_S / 2)  # EOF: every holder of the pipe has ended
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the planning process outlived the killed training process (still planning)")
    assert proc.returncode == -9 and "step 0" in out, out
