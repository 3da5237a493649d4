"""The one owner of process groups: one per aligned block of the launch's `Topology`.

Every rank creates, once and in the same order, the process groups of the aligned blocks
that the planners may use (`Topology.blocks`). For world 4 with 4 heads:

    size 1: (0) (1) (2) (3)   <- no process group: a one-rank group needs no collective
    size 2: (0 1) (2 3)
    size 4: (0 1 2 3)          <- the whole world reuses the default group

Plus one more group of the whole world, `grad_sync`, used by the gradient sync alone: its
bucketed all-reduces overlap the last backward, where a whole-world SP group may still run
all-to-alls on the default group; a group of its own keeps every rank's order of
collectives on each group the same.

`group(ranks)` of a one-rank block (and every block of a one-rank world) is None, for which
every collective in `runtime.comm` is the single-rank no-op.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch.distributed as dist

from dcparallel.runtime import comm
from dcparallel.spec import ClusterSpec
from dcparallel.topology import Topology

log = logging.getLogger(__name__)


class ProcessGroups:
    """Creates every allowed SP group of a cluster and hands them out by their ranks.

    ``cluster``: a ClusterSpec (multi-node: groups follow its GPUs per node), or the world
    size, or None = one node holding the whole launched world."""

    def __init__(self, num_heads: int, cluster: ClusterSpec | int | None = None):
        world, rank = comm.world_size(), comm.world_rank()
        if cluster is None or isinstance(cluster, int):
            size = world if cluster is None else cluster
            if size != world:
                raise ValueError(
                    f"ProcessGroups was given world size {size} but torch.distributed runs {world} ranks; "
                    f"pass the launched world size (or nothing)"
                )
            cluster = ClusterSpec(world_size=world, gpus_per_node=world)
        if cluster.world_size != world:
            raise ValueError(
                f"the cluster spec says world_size={cluster.world_size} but torch.distributed runs "
                f"{world} ranks; build the ClusterSpec from the launched world size"
            )
        self.cluster = cluster
        self.topology = Topology.of(cluster, num_heads)  # validates num_heads
        self.num_heads = num_heads
        self.world_size = world
        self.rank = rank
        self.blocks: tuple[tuple[int, ...], ...] = tuple(self.topology.blocks())
        self._groups: dict[tuple[int, ...], object] = {}
        start = time.perf_counter()
        for ranks in self.blocks:  # same order on every rank: new_group is collective
            if len(ranks) == 1:
                self._groups[ranks] = None
            elif len(ranks) == world:
                self._groups[ranks] = dist.group.WORLD
            else:
                self._groups[ranks] = dist.new_group(list(ranks))
        self.grad_sync = dist.new_group(list(range(world))) if world > 1 else None
        self.creation_seconds = time.perf_counter() - start
        log.info(
            "rank %d: created %d process groups (sizes %s) in %.1f ms",
            rank,
            len(self.blocks),
            self.sizes,
            1e3 * self.creation_seconds,
        )

    @property
    def sizes(self) -> list[int]:
        return list(self.topology.sizes)

    def group(self, ranks: Sequence[int]):
        """The process group of an aligned block (None when the world is one rank)."""
        key = tuple(int(r) for r in ranks)
        try:
            return self._groups[key]
        except KeyError:
            raise ValueError(
                f"no process group was created for ranks {key}: the allowed groups of world "
                f"{self.world_size} with {self.num_heads} heads are {list(self.blocks)}; plan with "
                f"dcparallel.topology.Topology (aligned blocks of an allowed size)"
            ) from None

    def describe(self) -> str:
        lines = []
        for k in self.sizes:
            lines.append(
                f"size {k}: "
                + " ".join("(" + " ".join(map(str, b)) + ")" for b in self.blocks if len(b) == k)
            )
        return "\n".join(lines)
