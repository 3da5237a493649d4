"""Backend and CUDA device of a launch (runtime/launch.py) on a CPU machine: the device
queries are monkeypatched, so these check the choice, not a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dcparallel.runtime import launch as launch_mod
from dcparallel.runtime.launch import choose_backend, init_distributed

LAUNCH_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "DCPARALLEL_BACKEND",
    "DCPARALLEL_SHARE_DEVICE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def test_the_backend_env_runs_gloo_on_cuda():
    assert choose_backend(None, cuda_available=True, env={"DCPARALLEL_BACKEND": "gloo"}) == ("gloo", "cuda")
    assert choose_backend("cuda", cuda_available=True, env={"DCPARALLEL_BACKEND": "NCCL"}) == ("nccl", "cuda")
    assert choose_backend(None, cuda_available=True, env={}) == ("nccl", "cuda")
    assert choose_backend(None, cuda_available=False, env={"DCPARALLEL_BACKEND": "gloo"}) == ("gloo", "cpu")
    with pytest.raises(ValueError, match="DCPARALLEL_BACKEND='mpi': the backend must be 'nccl' or 'gloo'"):
        choose_backend(None, cuda_available=True, env={"DCPARALLEL_BACKEND": "mpi"})
    with pytest.raises(ValueError, match="DCPARALLEL_BACKEND=nccl needs CUDA devices"):
        choose_backend("cpu", cuda_available=True, env={"DCPARALLEL_BACKEND": "nccl"})


def test_a_rank_beyond_the_devices_needs_the_share_opt_in_and_gloo():
    assert launch_mod.cuda_device_index(3, 8, "nccl", env={}) == 3
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but this process sees 2 CUDA .*DCPARALLEL_SHARE_DEVICE=1"):
        launch_mod.cuda_device_index(2, 2, "nccl", env={})
    with pytest.raises(ValueError, match="which nccl refuses; set DCPARALLEL_BACKEND=gloo"):
        launch_mod.cuda_device_index(2, 2, "nccl", env={"DCPARALLEL_SHARE_DEVICE": "1"})
    share = {"DCPARALLEL_SHARE_DEVICE": "1"}
    assert [launch_mod.cuda_device_index(r, 2, "gloo", env=share) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="sees no CUDA device"):
        launch_mod.cuda_device_index(0, 0, "nccl", env={})


def _fake_cuda(monkeypatch, count: int, env: dict[str, str]) -> list:
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    chosen: list = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_slurm_one_gpu_per_task_uses_cuda_0(monkeypatch):
    """srun with --gpus-per-task=1: every task sees one GPU (CUDA_VISIBLE_DEVICES one id) as
    cuda:0, whatever its LOCAL_RANK."""
    chosen = _fake_cuda(monkeypatch, 1, {"CUDA_VISIBLE_DEVICES": "5", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"})
    got = init_distributed()
    assert got.device == torch.device("cuda", 0) and chosen == [torch.device("cuda", 0)]
    assert got.world_size == 1 and got.backend is None


def test_one_gpu_for_several_ranks_without_the_opt_in_is_a_clear_error(monkeypatch):
    _fake_cuda(monkeypatch, 1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="LOCAL_RANK=1 but this process sees 1 CUDA device"):
        init_distributed()


class _Started(Exception):
    pass


def test_shared_gpu_ranks_start_gloo_without_a_device_binding(monkeypatch):
    """Rank 1 of 2 on a node with one GPU, DCPARALLEL_BACKEND=gloo and the share opt-in: it uses
    cuda:0 and starts a gloo group with no ``device_id`` (that binds NCCL communicators)."""
    chosen = _fake_cuda(
        monkeypatch,
        1,
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
            "DCPARALLEL_BACKEND": "gloo",
            "DCPARALLEL_SHARE_DEVICE": "1",
        },
    )
    calls = []

    def init_pg(backend, **kw):
        calls.append((backend, kw))
        raise _Started

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: dist.HashStore())
    monkeypatch.setattr(dist, "init_process_group", init_pg)
    with pytest.raises(_Started):
        launch_mod.init_distributed()
    assert chosen == [torch.device("cuda", 0)]
    ((backend, kw),) = calls
    assert backend == "gloo" and "device_id" not in kw and (kw["rank"], kw["world_size"]) == (1, 2)
