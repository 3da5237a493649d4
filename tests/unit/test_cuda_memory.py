"""The launcher's CUDA allocator setting and the memory the train metrics report on CUDA,
checked on a CPU build with the device queries stubbed."""

from __future__ import annotations

import os

import torch

from dcparallel.profile import measure
from dcparallel.runtime import launch


def test_expandable_segments_are_set_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    env: dict[str, str] = {}
    launch.configure_cuda_allocator(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        mine = {key: "max_split_size_mb:128"}
        launch.configure_cuda_allocator(mine)
        assert mine == {key: "max_split_size_mb:128"}


def test_init_distributed_configures_the_allocator_first(monkeypatch):
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "")  # recorded, so that the test's setting is undone afterwards
        monkeypatch.delenv(key)
    launch.init_distributed(device="cpu")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_cuda_steps_report_allocated_reserved_and_device_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * 2**30, 140 * 2**30))
    assert launch.cuda_memory(torch.device("cuda", 0)) == {
        "measured_peak_memory_bytes": 3 * 2**30,
        "measured_peak_reserved_bytes": 4 * 2**30,
        "device_free_bytes": 100 * 2**30,
        "device_total_bytes": 140 * 2**30,
    }
    assert set(launch.cuda_memory(torch.device("cpu")).values()) == {None}


def test_a_profile_memory_run_reads_activations_and_keeps_the_worst_device_memory(monkeypatch):
    state = {"allocated": 10, "peak": 10}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: state["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 2 * state["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000 - 2 * state["peak"], 1000))

    def run(peak: int):
        return lambda: state.update(peak=peak)

    cuda = torch.device("cuda", 0)
    first, seen1 = measure.cuda_run_memory(cuda, run(110))
    second, seen2 = measure.cuda_run_memory(cuda, run(60))
    assert (first, second) == (100.0, 50.0)  # the peak above what was allocated before the run
    worst = measure.worst_cuda_memory(measure.worst_cuda_memory(None, seen1), seen2)
    assert worst == {
        "measured_peak_memory_bytes": 110,
        "measured_peak_reserved_bytes": 220,
        "device_free_bytes": 780,
        "device_total_bytes": 1000,
    }
