"""Planning ahead in a planning process: the same plans as planning in-process, the planner
really runs in another process (a fresh interpreter, not a fork, kept across epochs), a
resumed epoch starts where it stopped, a planning failure or a dead planning process
reaches the training loop as an error, and the planning process logs where its rank does."""

from __future__ import annotations

import gc
import logging
import os

import pytest

from dcparallel.data import loader as loader_mod
from dcparallel.plan import policies

from .test_loader import make, text_data


def test_process_plans_equal_thread_and_in_place_plans():
    ds, lens = text_data(60, seed=3)
    got = {}
    for planning, lookahead in (("thread", 0), ("thread", 2), ("process", 1), ("process", 3)):
        got[(planning, lookahead)] = [
            (s.index, s.plan.to_json(), s.sample_ids)
            for s in make(ds, lens, world=2, rank=1, planning=planning, lookahead=lookahead)
        ]
    ref = got[("thread", 0)]
    assert len(ref) > 3
    for key, plans in got.items():
        assert plans == ref, key


def test_the_planner_runs_in_another_process_kept_for_the_next_epochs(monkeypatch):
    def not_here(*a, **k):
        raise AssertionError("a planner was built in the training process")

    monkeypatch.setattr(loader_mod, "make_planner", not_here)
    monkeypatch.setattr(policies, "make_planner", not_here)
    ds, lens = text_data(30, seed=1)
    ld = make(ds, lens, planning="process", lookahead=2)
    steps = list(ld)
    assert steps and ld.last_plan_seconds > 0
    (worker,) = ld.idle_workers  # back in the loader's hands once the epoch ended
    assert worker.proc.pid != os.getpid() and worker.proc.poll() is None
    ld.set_epoch(1)
    assert [s.epoch for s in ld] == [1] * len(ld)
    assert ld.idle_workers == [worker] and worker.proc.poll() is None  # the same process, reused
    del ld
    gc.collect()
    assert worker.proc.wait(timeout=10) == 0  # the loader collected: its planning process ends


def test_start_planning_starts_the_process_the_first_epoch_uses():
    ds, lens = text_data(30, seed=1)
    ld = make(ds, lens, planning="process", lookahead=2)
    ld.start_planning()
    (worker,) = ld.idle_workers
    assert worker.alive()
    ld.start_planning()  # once is enough
    assert ld.idle_workers == [worker]
    assert len(list(ld)) == len(ld) and ld.idle_workers == [worker]
    thread = make(ds, lens, planning="thread")
    thread.start_planning()
    assert thread.idle_workers == []


def test_a_cost_model_the_planning_process_cannot_import_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "script_only.py").write_text("class Extra:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import script_only

    ds, lens = text_data(20, seed=0)
    ld = make(ds, lens, planning="process")
    ld.context.cost.extra = script_only.Extra()  # a class the planning process cannot import
    (tmp_path / "script_only.py").unlink()
    with pytest.raises(
        RuntimeError,
        match=r"could not load the loader's policy and cost model: ModuleNotFoundError: "
        r"No module named 'script_only'.*pass planning='thread'",
    ):
        list(ld)
    assert ld.idle_workers == []


def test_two_iterations_at_once_get_a_process_each():
    ds, lens = text_data(40, seed=4)
    ld = make(ds, lens, planning="process", lookahead=1)
    ref = [(s.index, s.sample_ids) for s in make(ds, lens, planning="thread")]
    a, b = iter(ld), iter(ld)
    got_a, got_b = [next(a)], [next(b)]
    got_a += list(a)
    got_b += list(b)
    assert [(s.index, s.sample_ids) for s in got_a] == ref == [(s.index, s.sample_ids) for s in got_b]
    assert len({w.proc.pid for w in ld.idle_workers}) == 2


_FORKED = {"marker": None}


def _mark_fork() -> None:
    if _FORKED["marker"] is not None:
        _FORKED["marker"].touch()


os.register_at_fork(after_in_child=_mark_fork)


def test_the_planning_process_is_not_a_fork(tmp_path):
    """At-fork hooks (W&B's and OpenTelemetry's start threads) never run in the planning
    process: it is a fresh interpreter, not a fork of the training process."""
    marker = tmp_path / "forked"
    _FORKED["marker"] = marker
    try:
        ds, lens = text_data(30, seed=1)
        steps = list(make(ds, lens, planning="process", lookahead=2))
    finally:
        _FORKED["marker"] = None
    assert steps and not marker.exists()


def test_a_planning_process_that_dies_is_an_error_naming_the_step():
    ds, lens = text_data(60, seed=5)
    ld = make(ds, lens, planning="process", lookahead=1)
    ld.start_planning()
    (worker,) = ld.idle_workers  # the process the epoch below plans in
    it = iter(ld)
    next(it)
    worker.proc.kill()
    worker.proc.wait()
    with pytest.raises(RuntimeError, match=r"the planning process ended before step \d+ was planned \(exit code -9\)"):
        list(it)
    assert ld.idle_workers == []  # a dead worker is not kept


def test_an_idle_planning_process_that_died_is_replaced():
    ds, lens = text_data(30, seed=6)
    ld = make(ds, lens, planning="process", lookahead=2)
    first = [(s.index, s.sample_ids) for s in ld]
    (dead,) = ld.idle_workers
    dead.proc.kill()
    dead.proc.wait()
    assert [(s.index, s.sample_ids) for s in ld] == first  # the same epoch again, a new process
    (worker,) = ld.idle_workers
    assert worker is not dead and worker.alive()


def test_process_planning_resumes_mid_epoch():
    ds, lens = text_data(50, seed=2)
    full = [(s.index, s.sample_ids) for s in make(ds, lens, planning="process")]
    ld = make(ds, lens, planning="process")
    it = iter(ld)
    next(it), next(it)
    state = ld.state_dict()
    it.close()
    again = make(ds, lens, planning="process")
    again.load_state_dict(state)
    assert [(s.index, s.sample_ids) for s in again] == full[2:]


def test_planning_error_reaches_the_loop():
    ds, lens = text_data(20, seed=0)
    ld = make(ds, lens, planning="process")
    ld.policy = "exploded"  # the planning process cannot build this planner
    with pytest.raises(RuntimeError, match="failed in the planning process: ValueError: unknown policy 'exploded'"):
        list(ld)


def test_unknown_planning_mode_is_named():
    ds, lens = text_data(4)
    with pytest.raises(ValueError, match="planning must be 'thread' or 'process'; got 'gpu'"):
        make(ds, lens, planning="gpu")


@pytest.mark.parametrize("level", [logging.NOTSET, logging.ERROR])
def test_the_planning_process_warns_where_its_rank_does(level, monkeypatch, capfd):
    """A rank that passes errors only (`launch.quiet_other_ranks`: every rank but 0) has a
    planning process that does too: a cost model's warning (here a packed bin far beyond a
    profile's one 64-token bucket, met while `packed` is tuned in the planning process)
    reaches stderr once, from rank 0's planner, not once per rank."""
    from dcparallel.cost.profiled import ProfiledCost
    from dcparallel.cost.schema import Profile
    from dcparallel.data.loader import DataCentricLoader
    from dcparallel.spec import ClusterSpec
    from tests.support import one_entry_profile_json
    from tests.unit.test_suggested_fixes import TINY

    monkeypatch.setattr(logging.getLogger("dcparallel"), "level", level)
    cl = ClusterSpec(world_size=1, gpus_per_node=1, memory_bytes=2**40)
    cost = ProfiledCost(Profile.from_json(one_entry_profile_json(TINY)), cl)
    ds, lens = text_data(40, seed=0, lo=60, hi=64)
    ld = DataCentricLoader(ds, lens, cost=cost, cluster=cl, policy="packed", planning="process", tokens_per_step=2000)
    assert len(list(ld)) == len(ld)
    err = capfd.readouterr().err
    assert ("far beyond the profiled range" in err) == (level == logging.NOTSET), err
