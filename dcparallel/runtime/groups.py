"""The one owner of process groups: one per aligned block of the launch's `Topology`.

Every rank makes, once per process and in the same order, the process groups of the aligned
blocks that the planners may use (`Topology.blocks`). For world 4 with 4 heads:

    size 1: (0) (1) (2) (3)   <- no process group: a one-rank group needs no collective
    size 2: (0 1) (2 3)
    size 4: (0 1 2 3)          <- the whole world reuses the default group

Plus one more group of the whole world, `grad_sync`, used by the gradient sync alone: its
bucketed all-reduces overlap the last backward, where a whole-world SP group may still run
all-to-alls on the default group; a group of its own keeps every rank's order of
collectives on each group the same.

How they are made depends on the default group's backend:

- **gloo**: one ``new_group`` per block (cheap, CPU-only, no communicator memory);
- **NCCL** (and torch's ``fake`` backend, which tests use to take this path): one creation
  per SP size. With a device bound to the default group (``init_process_group(device_id=)``)
  every ``new_group`` is a world-wide ``ncclCommSplit``, so all blocks of a size come from one
  ``dist.split_group``; without one, each rank makes only its own block's group with
  ``new_group(use_local_synchronization=True)``, which involves its members alone.

The groups of each size (and `grad_sync`) are cached for the process and shared by every
`ProcessGroups` (and so every `Engine`) of the same default group: a second engine creates
nothing. On CUDA the memory the new communicators take (device free memory before creation
minus after a first collective on each) is added to `communicator_bytes`, which
`DataCentricParallel` takes out of the default memory budget the planner uses.

`group(ranks)` of a one-rank block (and every block of a one-rank world) is None, for which
every collective in `runtime.comm` is the single-rank no-op.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dcparallel.runtime import comm
from dcparallel.runtime.ring import RingPeers
from dcparallel.spec import ClusterSpec
from dcparallel.topology import Topology

log = logging.getLogger(__name__)

#: default-group backends whose groups are made one creation per SP size (also when one
#: device type's backend of several, e.g. "cpu:gloo,cuda:nccl")
PER_SIZE_BACKENDS = ("nccl", "fake")


def _backend() -> str:
    return str(dist.get_backend()).lower()


def _per_size() -> bool:
    backend = _backend()
    return any(b == backend or f":{b}" in backend for b in PER_SIZE_BACKENDS)


def _comm_device() -> torch.device | None:
    """The CUDA device whose free memory the communicators take (None: not measured)."""
    if "nccl" in _backend() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _device_bound() -> bool:
    """Whether the default group has a device bound (then each ``new_group`` splits it)."""
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None


def _warm_up(group, device: torch.device) -> None:
    """A first collective on ``group``: NCCL allocates a communicator's buffers on first use."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(device)


def _blocks_of(k: int, world: int) -> list[list[int]]:
    return [list(range(s, s + k)) for s in range(0, world - k + 1, k)]


def _create_size(k: int, world: int, rank: int):
    """This rank's group among the aligned blocks of ``k`` ranks (None where no block of
    ``k`` holds it), made with one collective creation on NCCL / fake, one per block on gloo."""
    blocks = _blocks_of(k, world)
    mine = next((b for b in blocks if rank in b), None)
    if not _per_size():
        made = [dist.new_group(b) for b in blocks]  # collective: every rank, every block
        return None if mine is None else made[blocks.index(mine)]
    if _device_bound() and hasattr(dist, "split_group"):
        return dist.split_group(split_ranks=blocks)  # one world-wide ncclCommSplit for the size
    if mine is None:
        return None
    return dist.new_group(mine, use_local_synchronization=True)  # its members alone


class _GroupCache:
    """The process groups of one default group, made once per process: this rank's group
    of each SP size, `grad_sync`'s world group, and the device memory they took."""

    def __init__(self, world_group):
        self.world_group = world_group
        self.by_size: dict[int, object] = {}
        self.grad_sync = None
        self.communicator_bytes = 0
        self.creations = 0  # process-group creation calls made here (sizes + the sync's)

    def ensure(self, sizes: Sequence[int], world: int, rank: int) -> None:
        """Creates the groups of ``sizes`` not made yet (collective: every rank, same order)."""
        todo = [k for k in sorted(sizes) if 1 < k < world and k not in self.by_size]
        sync = world > 1 and self.grad_sync is None
        if not todo and not sync:
            return
        device = _comm_device()
        free = torch.cuda.mem_get_info(device)[0] if device is not None else 0
        new = []
        for k in todo:
            self.by_size[k] = _create_size(k, world, rank)
            new.append(self.by_size[k])
        if sync:
            self.grad_sync = dist.new_group(list(range(world)))
            new.append(self.grad_sync)
        self.creations += len(todo) + sync
        if device is not None:
            for g in new:
                if g is not None:
                    _warm_up(g, device)
            self.communicator_bytes += max(0, free - torch.cuda.mem_get_info(device)[0])


_cache: list[_GroupCache] = []


def group_cache() -> _GroupCache:
    """The cache of the current default group (a re-initialized world gets a new one)."""
    world_group = dist.group.WORLD if comm.is_distributed() else None
    if not _cache or _cache[0].world_group is not world_group:
        _cache[:] = [_GroupCache(world_group)]
    return _cache[0]


def _world_fix(planned: int, world: int) -> str:
    """The fix for a cluster spec whose world size is not the process group's."""
    if world == 1 and planned > 1 and not dist.is_initialized():
        return (
            "no process group is set up: launch with torchrun and create the DataCentricParallel there (it "
            "sets the process group up), or call dcparallel.init_distributed() before building the engine"
        )
    return "plan for the launched world size (dcparallel.runtime.launch.cluster_from_env() reads it)"


class ProcessGroups:
    """Hands out every allowed SP group of a cluster by its ranks (made once per process:
    see the module docstring).

    ``cluster``: a ClusterSpec (multi-node: groups follow its GPUs per node), or the world
    size, or None = one node holding the whole launched world. ``ring``: also the sizes the
    heads do not divide, whose micro-batches run Ulysses x ring attention (`split`); None:
    the ClusterSpec's `ClusterSpec.ring` (off for a world size or None)."""

    def __init__(self, num_heads: int, cluster: ClusterSpec | int | None = None, ring: bool | None = None):
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
                f"{world} ranks; {_world_fix(cluster.world_size, world)}"
            )
        self.cluster = cluster
        self.topology = Topology.of(cluster, num_heads, ring)  # validates num_heads
        self.num_heads = num_heads
        self.world_size = world
        self.rank = rank
        self.blocks: tuple[tuple[int, ...], ...] = tuple(self.topology.blocks())
        start = time.perf_counter()
        cache = group_cache()
        cache.ensure(self.sizes, world, rank)
        self.grad_sync = cache.grad_sync
        self._by_size = {
            k: (None if k == 1 else dist.group.WORLD if k == world else cache.by_size[k]) for k in self.sizes
        }
        #: device memory of every communicator this process made (CUDA; 0 elsewhere)
        self.communicator_bytes = cache.communicator_bytes
        self.creation_seconds = time.perf_counter() - start
        log.info(
            "rank %d: process groups of sizes %s ready in %.1f ms (%d creations in this process, "
            "communicators %.0f MiB)",
            rank,
            self.sizes,
            1e3 * self.creation_seconds,
            cache.creations,
            self.communicator_bytes / 2**20,
        )

    @property
    def sizes(self) -> list[int]:
        return list(self.topology.sizes)

    def group(self, ranks: Sequence[int]):
        """The process group of an aligned block holding this rank (None for a block of one
        rank, any rank's: it needs no collective)."""
        key = tuple(int(r) for r in ranks)
        if not self.topology.is_block(key) or key[0] < 0:
            raise ValueError(
                f"no process group was created for ranks {key[:8]}{' ...' if len(key) > 8 else ''} ({len(key)} "
                f"ranks): the groups of world {self.world_size} with {self.num_heads} heads are aligned blocks "
                f"of sizes {self.sizes}; plan with dcparallel.topology.Topology"
            )
        if len(key) > 1 and self.rank not in key:
            raise ValueError(
                f"rank {self.rank} asked for the group of ranks {key}, which it is not in; a rank "
                f"runs only the micro-batches of its own groups (StepPlan.work_of)"
            )
        return self._by_size[len(key)]

    def split(self, ranks: Sequence[int], ring: int) -> tuple[object, RingPeers | None]:
        """A micro-batch's groups under ring degree ``ring``: this rank's Ulysses sub-group
        (the ``len(ranks) / ring`` consecutive ranks of its ring block; None for one rank) and
        its ring (`RingPeers`: the ranks at the same place in every sub-group, in block order,
        sending through the group of ``ranks``); with ring 1, the group of ``ranks`` and None.

            k = 4, (u, r) = (2, 2):  Ulysses (0 1) (2 3)    rings (0 2) (1 3)
        """
        key = tuple(int(r) for r in ranks)
        whole = self.group(key)  # validates the block and that this rank is in it
        if ring == 1:
            return whole, None
        u = len(key) // ring
        if (u, ring) not in self.topology.splits(len(key)):
            raise ValueError(
                f"an SP group of {len(key)} ranks cannot run Ulysses degree {u} x ring degree {ring} "
                f"with {self.num_heads} heads here; the splits are {self.topology.splits(len(key))} "
                f"(ProcessGroups(..., ring=True) offers sizes beyond the heads)"
            )
        j, i = divmod(key.index(self.rank), u)
        sub = None if u == 1 else self.group(key[j * u : (j + 1) * u])
        return sub, RingPeers(whole, key[i::u], j)

    def describe(self) -> str:
        lines = []
        for k in self.sizes:
            lines.append(
                f"size {k}: " + " ".join("(" + " ".join(map(str, b)) + ")" for b in self.blocks if len(b) == k)
            )
        return "\n".join(lines)
