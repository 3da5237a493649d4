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

Also here: what the launch means for the cost model — link speeds it can price
(`priced_cluster`) and ``shard_size="auto"`` agreed by every rank (`agreed_auto_shard_size`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from dcparallel.cost.auto_shard import explain_shard_size
from dcparallel.runtime import comm
from dcparallel.spec import ClusterSpec, ModelSpec

log = logging.getLogger(__name__)

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
        raise ValueError(
            f"the model is on {current} but this rank's device is {device} (LOCAL_RANK="
            f"{os.environ.get('LOCAL_RANK')}): build it on the CPU and let DataCentricParallel move "
            f"it, or move it to cuda:LOCAL_RANK yourself (or call dcparallel.init_distributed() first "
            f"and use its .device)"
        )
    return device


def priced_cluster(cluster: ClusterSpec, **changes: Any) -> ClusterSpec:
    """``cluster`` with link speeds the analytic cost model can price: 1e10 bytes/s per GPU
    for a link the launch gave no speed for (`runtime.launch.cluster_from_env`)."""
    return dataclasses.replace(cluster, intra_bw=cluster.intra_bw or 1e10, inter_bw=cluster.inter_bw or 1e10, **changes)


def agreed_auto_shard_size(spec: ModelSpec, cluster: ClusterSpec) -> int:
    """``shard_size="auto"`` when the model is wrapped (its parameters are sharded then, before
    any sample is seen): the smallest shard size with which the model states fit the smallest
    memory budget of any rank (`cost.auto_shard`, the analytic recipe); the same on every rank,
    logged once with the reason."""
    priced = priced_cluster(cluster, memory_bytes=min(comm.all_gather_object(cluster.memory_bytes)))
    try:
        s, why = explain_shard_size(spec, priced)
    except ValueError as e:
        raise ValueError(
            f"shard_size='auto': {e} (the budget is memory_bytes per rank: pass a larger one if the device has more)"
        ) from None
    comm.check_equal(str(s), "shard_size auto")
    if comm.world_rank() == 0:
        log.info(why)
    return s
