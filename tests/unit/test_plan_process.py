"""Planning ahead in a separate process: the same plans as planning in-process, the planner
really runs in another process, a resumed epoch starts where it stopped, and a planning
failure reaches the training loop as an error."""

from __future__ import annotations

import os

import pytest

from dcparallel.data import loader as loader_mod

from .test_loader import make, text_data


def test_process_plans_equal_thread_and_in_place_plans():
    ds, lens = text_data(60, seed=3)
    got = {}
    for planning, lookahead in (("thread", 0), ("thread", 2), ("process", 1), ("process", 3)):
        got[(planning, lookahead)] = [(s.index, s.plan.to_json(), s.sample_ids)
                                      for s in make(ds, lens, world=2, rank=1, planning=planning,
                                                    lookahead=lookahead)]
    ref = got[("thread", 0)]
    assert len(ref) > 3
    for key, plans in got.items():
        assert plans == ref, key


def test_the_planner_runs_in_another_process(monkeypatch):
    pids = []
    original = loader_mod.DataCentricLoader.planner

    def spy(self, epoch):
        pids.append(os.getpid())
        return original(self, epoch)

    monkeypatch.setattr(loader_mod.DataCentricLoader, "planner", spy)
    ds, lens = text_data(30, seed=1)
    ld = make(ds, lens, planning="process", lookahead=2)
    steps = list(ld)
    assert steps and ld.last_plan_seconds > 0
    assert pids == []  # built in the child: this process never built a planner


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


def test_planning_error_reaches_the_loop(monkeypatch):
    def broken(self, epoch):
        raise RuntimeError("planner exploded")

    monkeypatch.setattr(loader_mod.DataCentricLoader, "planner", broken)
    ds, lens = text_data(20, seed=0)
    with pytest.raises(RuntimeError, match="planner exploded"):
        list(make(ds, lens, planning="process"))


def test_unknown_planning_mode_is_named():
    ds, lens = text_data(4)
    with pytest.raises(ValueError, match="planning must be 'thread' or 'process'; got 'gpu'"):
        make(ds, lens, planning="gpu")
