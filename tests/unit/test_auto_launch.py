"""What a user meets without a process-group set-up of their own (`runtime.auto_launch`):
outside torchrun nothing is set up and the model stays put; a cluster of several ranks with no
process group names the fix (torchrun + `DataCentricParallel`, or `dcparallel.init_distributed`)."""

from __future__ import annotations

import pytest
import torch

import dcparallel
from dcparallel.runtime.auto_launch import launched_by_torchrun, set_up_launch
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.spec import ClusterSpec


def test_outside_torchrun_nothing_is_set_up(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    model = torch.nn.Linear(2, 2)
    assert not launched_by_torchrun() and set_up_launch(model) is None
    assert not torch.distributed.is_initialized() and model.weight.device.type == "cpu"


def test_missing_process_group_names_the_launcher_fix(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="no process group is set up") as e:
        ProcessGroups(4, ClusterSpec(world_size=2, gpus_per_node=2))
    assert "dcparallel.init_distributed()" in str(e.value) and "ClusterSpec" not in str(e.value).split(";")[1]


def test_init_distributed_is_exported():
    from dcparallel.runtime.launch import init_distributed

    assert dcparallel.init_distributed is init_distributed and "init_distributed" in dcparallel.__all__
