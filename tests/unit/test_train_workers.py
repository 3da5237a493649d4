"""`dcparallel train` loads data in DataLoader workers on GPUs, started by spawn, and the
loader's transport works in spawned workers (the same batches as without workers)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from dcparallel.apps import train_setup

from .test_loader import make, text_data


@pytest.fixture
def start_method():
    before = multiprocessing.get_start_method(allow_none=True)
    yield
    multiprocessing.set_start_method(before, force=True)


def test_train_gets_spawned_loader_workers_on_a_gpu(monkeypatch, start_method):
    assert train_setup.loader_workers(torch.device("cpu")) == {}
    monkeypatch.setattr(train_setup, "on_gpu", lambda device: device.type == "meta")
    kw = train_setup.loader_workers(torch.device("meta"), local_world_size=1)
    assert 1 <= kw["num_workers"] <= train_setup.GPU_LOADER_WORKERS
    assert multiprocessing.get_start_method() == "spawn"


def test_spawned_workers_hand_out_the_same_batches(start_method):
    multiprocessing.set_start_method("spawn", force=True)
    ds, lens = text_data(12, seed=1)
    ref = [(s.index, s.plan, [b.inputs for b in s]) for s in make(ds, lens, world=2, rank=0)]
    got = [(s.index, s.plan, [b.inputs for b in s]) for s in make(ds, lens, world=2, rank=0, num_workers=1)]
    assert [g[:2] for g in got] == [r[:2] for r in ref]
    for g, r in zip(got, ref, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g[2], r[2], strict=True))
