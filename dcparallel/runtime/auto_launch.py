"""The process-group set-up `DataCentricParallel` does for a script started by torchrun, so
that the user's loop needs no set-up line of its own.

    torchrun --nproc-per-node 8 train.py      # train.py: model = ...; dc = DataCentricParallel(model)

Three cases, decided from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK):

- the user set up torch.distributed already: it is used as it is, and the model stays where
  the user put it;
- torchrun launched several ranks and nothing is set up: `launch.init_distributed` runs here
  (NCCL + cuda:LOCAL_RANK on GPUs, gloo on CPUs), and a model still on the CPU moves to this
  rank's device (what the user's ``model.to(device)`` would have had to name per rank);
- no torchrun: a world of one, the model stays where it is.

A model already on another GPU than this rank's (``model.cuda()`` puts every rank's copy on
cuda:0) is refused, naming the device it needs.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from torch import nn

#: seconds a collective may wait when `DataCentricParallel` sets the process group up
DEFAULT_TIMEOUT_S = 300


def launched_by_torchrun() -> bool:
    """Whether torchrun (or a launcher that sets the same variables) started several ranks."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def set_up_launch(model: nn.Module) -> torch.device | None:
    """Initializes torch.distributed when torchrun launched several ranks and nobody has yet
    (`launch.init_distributed`) and moves a CPU model to this rank's device; checks that a
    model on a GPU is on this rank's. Returns the device it chose, or None when it chose none
    (the process group was there already, or a world of one)."""
    import torch.distributed as dist

    from dcparallel.runtime.launch import init_distributed

    if dist.is_available() and dist.is_initialized() or not launched_by_torchrun():
        return None
    device = init_distributed(timeout=timedelta(seconds=DEFAULT_TIMEOUT_S)).device
    current = next(model.parameters()).device
    if current.type == "cpu" and device.type != "cpu":
        model.to(device)
    elif current.type == "cuda" and current != device:
        raise ValueError(f"the model is on {current} but this rank's device is {device} (LOCAL_RANK="
                         f"{os.environ.get('LOCAL_RANK')}): build it on the CPU and let DataCentricParallel move "
                         f"it, or move it to cuda:LOCAL_RANK yourself (or call dcparallel.init_distributed() first "
                         f"and use its .device)")
    return device
