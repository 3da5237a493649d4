"""Process and device set-up, in one place, for every entry point (train, demo, profile, the
examples): backend and device from the launch, the `ClusterSpec` the planners use, and what
a failed micro-batch does to the other ranks.

    launch = init_distributed()            # NCCL + cuda:LOCAL_RANK on GPUs, gloo on CPUs
    model = build_model().to(launch.device)
    cluster = cluster_from_env(num_heads=cfg.num_heads)

torchrun (or Slurm + torchrun) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; without
them the process is a world of one and no process group is created.

Link speeds come from a TOML file named by ``DCPARALLEL_LINKS`` (or passed in), one table::

    [links]
    intra_bw = 315e9        # bytes/s per GPU, one direction, inside a node (NVLink)
    intra_latency = 10e-6   # seconds per collective step
    inter_bw = 40e9         # bytes/s per GPU, one direction, between nodes (InfiniBand)
    inter_latency = 20e-6

Missing keys keep the datasheet defaults of `dcparallel.spec.h200_cluster` (H200 SXM,
NVLink 4, one 400 Gb/s NIC per GPU; not measured here).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from pathlib import Path

import torch

from dcparallel.spec import ClusterSpec, h200_cluster
from dcparallel.topology import group_sizes

log = logging.getLogger(__name__)

#: exit status of a rank that ran out of memory in a planned micro-batch (EX_TEMPFAIL)
OOM_EXIT_CODE = 75
#: each restart after an out-of-memory exit plans with this fraction of the budget before it
OOM_BUDGET_FACTOR = 0.9
#: usable fraction of a GPU's memory when no budget is given (the rest: CUDA context,
#: NCCL buffers, allocator fragmentation)
GPU_MEMORY_FRACTION = 0.9


@dataclass(frozen=True, kw_only=True)
class Launch:
    """What this process runs as."""

    backend: str | None
    """"nccl", "gloo", or None for a world of one without a process group"""
    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


#: environment variable that picks the backend on CUDA: "nccl" (the default) or "gloo"
BACKEND_ENV = "DCPARALLEL_BACKEND"
#: environment variable ("1") that lets several ranks of a node share one CUDA device (gloo only)
SHARE_DEVICE_ENV = "DCPARALLEL_SHARE_DEVICE"


def choose_backend(device: str | None, cuda_available: bool, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(backend, device type): NCCL on CUDA, gloo on CPU. ``device``: "cuda", "cpu" or None
    (CUDA when available). ``DCPARALLEL_BACKEND=gloo`` in ``env`` (default: os.environ) runs
    gloo on CUDA tensors: gloo, unlike NCCL, lets several ranks share one GPU (with
    ``DCPARALLEL_SHARE_DEVICE=1``), which is how one GPU tests a multi-rank launch."""
    env = os.environ if env is None else env
    kind = device or ("cuda" if cuda_available else "cpu")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu'; got {device!r}")
    if kind == "cuda" and not cuda_available:
        raise ValueError(
            "device 'cuda' was asked for but torch sees no CUDA device; use device='cpu' "
            "(gloo) or install a CUDA build of torch"
        )
    asked = env.get(BACKEND_ENV, "").strip().lower()
    if asked not in ("", "nccl", "gloo"):
        raise ValueError(
            f"{BACKEND_ENV}={asked!r}: the backend must be 'nccl' or 'gloo'; unset it for the "
            f"default (NCCL on CUDA, gloo on CPU)"
        )
    if asked == "nccl" and kind == "cpu":
        raise ValueError(
            f"{BACKEND_ENV}=nccl needs CUDA devices but this launch runs on CPU; unset it or set it to 'gloo'"
        )
    return (asked or ("nccl" if kind == "cuda" else "gloo")), kind


def cuda_device_index(local_rank: int, device_count: int, backend: str, env: Mapping[str, str] | None = None) -> int:
    """The CUDA device (index among the visible ones) of the rank with ``local_rank``:
    ``local_rank`` when the node shows one device per rank; 0 when the process sees exactly one
    device because ``CUDA_VISIBLE_DEVICES`` names one (Slurm's one GPU per task: the ranks of a
    node see different GPUs, each as cuda:0); ``local_rank % device_count`` when
    ``DCPARALLEL_SHARE_DEVICE=1`` lets ranks share devices, which only gloo allows (NCCL
    refuses two ranks on one GPU). Anything else is a ValueError naming the fixes."""
    env = os.environ if env is None else env
    if 0 <= local_rank < device_count:
        return local_rank
    if device_count < 1:
        raise ValueError(
            "torch sees no CUDA device (CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES')!r}); make a GPU visible or run on CPU"
        )
    visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if device_count == 1 and len(visible) == 1:
        return 0
    if env.get(SHARE_DEVICE_ENV, "") == "1":
        if backend != "gloo":
            raise ValueError(
                f"{SHARE_DEVICE_ENV}=1 puts LOCAL_RANK={local_rank} on a GPU another rank "
                f"uses, which {backend} refuses; set {BACKEND_ENV}=gloo as well"
            )
        return local_rank % device_count
    raise ValueError(
        f"LOCAL_RANK={local_rank} but this process sees {device_count} CUDA device(s); launch at "
        f"most that many processes per node (--nproc-per-node), give each task one GPU of its "
        f"own (CUDA_VISIBLE_DEVICES=<one id>, Slurm --gpus-per-task=1), or share devices for a "
        f"test with {BACKEND_ENV}=gloo {SHARE_DEVICE_ENV}=1"
    )


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer; it is set by torchrun") from None


def restart_attempt() -> int:
    """Which restart of the job this is under ``torchrun --max-restarts`` (0: the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


#: the CUDA allocator's setting unless the user gave one: shapes change every micro-batch, and
#: expandable segments grow one mapping instead of leaving blocks of each old size reserved
CUDA_ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator(env: os._Environ | dict = os.environ) -> None:
    """Sets ``PYTORCH_CUDA_ALLOC_CONF`` to `CUDA_ALLOC_CONF` when neither it nor
    ``PYTORCH_ALLOC_CONF`` is set (a user's setting is kept). The allocator reads it when
    CUDA initializes, so this runs first in `init_distributed`; later it has no effect."""
    if "PYTORCH_CUDA_ALLOC_CONF" in env or "PYTORCH_ALLOC_CONF" in env:
        return
    if torch.cuda.is_initialized():
        log.warning(
            "CUDA is already initialized: PYTORCH_CUDA_ALLOC_CONF=%s (set by dcparallel) takes no effect; "
            "set it in the environment before starting",
            CUDA_ALLOC_CONF,
        )
    env["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF


def cuda_memory(device: torch.device) -> dict[str, int | None]:
    """The allocator's peaks since the last ``reset_peak_memory_stats`` (allocated: tensors;
    reserved: held by the caching allocator) and the device's free and total memory
    (``mem_get_info``: also other processes and the CUDA context). None off CUDA."""
    if device.type != "cuda":
        return dict.fromkeys(
            ("measured_peak_memory_bytes", "measured_peak_reserved_bytes", "device_free_bytes", "device_total_bytes")
        )
    free, total = torch.cuda.mem_get_info(device)
    return {
        "measured_peak_memory_bytes": torch.cuda.max_memory_allocated(device),
        "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "device_free_bytes": free,
        "device_total_bytes": total,
    }


def init_distributed(device: str | None = None, timeout: timedelta = timedelta(seconds=300)) -> Launch:
    """Initializes torch.distributed from the torchrun environment (once; a second call
    returns the same answer): on CUDA ``torch.cuda.set_device`` to the rank's device
    (`cuda_device_index`: cuda:LOCAL_RANK as a rule) then NCCL bound to that device, or gloo
    with ``DCPARALLEL_BACKEND=gloo`` (`choose_backend`); on CPU gloo. ``timeout``: per
    collective; keep it short so that a rank that died does not leave the others waiting for
    30 minutes. The CUDA allocator is configured first (`configure_cuda_allocator`)."""
    import torch.distributed as dist

    configure_cuda_allocator()
    env = os.environ
    backend, kind = choose_backend(device, torch.cuda.is_available(), env)
    world = _env_int(env, "WORLD_SIZE", 1)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", world)
    dev = torch.device("cpu")
    if kind == "cuda":
        dev = torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count(), backend, env))
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        if dist.get_backend() != backend:
            log.warning("torch.distributed already runs %s (asked for %s)", dist.get_backend(), backend)
    elif "RANK" not in env or world == 1:
        return Launch(backend=None, device=dev, rank=0, local_rank=0, world_size=1, local_world_size=1)
    else:
        kw = {"device_id": dev} if backend == "nccl" else {}  # NCCL binds its communicator to the device
        rank = _env_int(env, "RANK", 0)
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        # Under torchrun the agent's TCPStore outlives a restart: without a prefix of its own,
        # a restarted rank reads the gloo addresses the failed attempt published and fails
        # ("Gloo connectFullMesh failed ... Connection refused"), and so does every restart.
        store = dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=not agent and rank == 0, timeout=timeout
        )
        store = dist.PrefixStore(f"dcparallel/attempt{restart_attempt()}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
        quiet_other_ranks(rank)
    return Launch(
        backend=dist.get_backend(),
        device=dev,
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        local_world_size=local_world,
    )


def quiet_other_ranks(rank: int) -> None:
    """Rank 0 speaks: on every other rank dcparallel's loggers pass errors only (every rank
    runs the same set-up, so their warnings would repeat rank 0's, interleaved). A level the
    user set on the ``dcparallel`` logger is kept."""
    logger = logging.getLogger("dcparallel")
    if rank != 0 and logger.level == logging.NOTSET:
        logger.setLevel(logging.ERROR)


# ---------------------------------------------------------------- the cluster of this launch


@dataclass(frozen=True, kw_only=True)
class Links:
    """Link speeds of the cluster (bytes/s per GPU one direction, seconds per step)."""

    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float

    @staticmethod
    def datasheet() -> Links:
        h = h200_cluster(8, 8)
        return Links(
            intra_bw=h.intra_bw, intra_latency=h.intra_latency, inter_bw=h.inter_bw, inter_latency=h.inter_latency
        )

    @staticmethod
    def load(path: str | Path | None = None) -> Links:
        """From the TOML file ``path`` (default: $DCPARALLEL_LINKS; none: the datasheet)."""
        import tomllib

        path = path or os.environ.get("DCPARALLEL_LINKS")
        base = Links.datasheet()
        if not path:
            return base
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read the link config {path}: {exc}") from exc
        values = raw.get("links", {})
        known = {f.name for f in fields(Links)}
        bad = sorted(set(values) - known) + sorted(set(raw) - {"links"})
        if bad:
            raise ValueError(f"{path}: unknown key(s) {bad}; a [links] table with keys {sorted(known)}")
        out = replace(base, **{k: float(v) for k, v in values.items()})
        for f in fields(Links):
            if getattr(out, f.name) < 0 or (f.name.endswith("_bw") and getattr(out, f.name) == 0):
                raise ValueError(f"{path}: {f.name} = {getattr(out, f.name)} must be positive")
        return out


def end_distributed() -> None:
    """Ends the default process group at the end of a run that went well: first frees what
    nothing reaches any more (an engine's groups and gradient-sync work in reference cycles),
    then waits for every rank, then destroys the group. Callers drop their own engines,
    optimizers and profilers before. (Left to the interpreter's exit after the group is
    destroyed, they took down a gloo thread unjoined: 'terminate called without an active
    exception', an abort in 3 of 18 two-rank runs on a loaded 2-core machine; 0 of 38 so.)"""
    import gc

    import torch.distributed as dist

    from dcparallel.runtime import comm

    if not dist.is_initialized():
        return
    gc.collect()
    comm.barrier()  # no rank tears its groups down while another still talks to it
    dist.destroy_process_group()


def device_memory(device: torch.device, local_world_size: int = 1) -> int:
    """Usable memory per rank: a fraction of the GPU's memory, or on CPU the machine's
    memory shared by the node's ranks."""
    if device.type == "cuda":
        return int(GPU_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local_world_size))


def default_device() -> torch.device:
    """This process's device: the current CUDA device (set by `init_distributed`), else CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def cluster_from_env(
    *,
    num_heads: int | None = None,
    memory_bytes: int | None = None,
    gpus_per_node: int | None = None,
    links: Links | None = None,
    device: torch.device | None = None,
    env: Mapping[str, str] | None = None,
) -> ClusterSpec:
    """The `ClusterSpec` of this launch: world from WORLD_SIZE (or the process group), GPUs
    per node from LOCAL_WORLD_SIZE (or ``gpus_per_node``), memory per rank from the device
    (or ``memory_bytes``), links from ``links`` / $DCPARALLEL_LINKS / the datasheet.
    Raises ValueError for a launch the planners cannot use: nodes of unequal size, or heads
    that no SP degree > 1 divides."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else _env_int(env, "WORLD_SIZE", 1)
    local = gpus_per_node or min(_env_int(env, "LOCAL_WORLD_SIZE", world), world)
    if local < 1 or world % local:
        raise ValueError(
            f"WORLD_SIZE={world} is not a whole number of nodes of LOCAL_WORLD_SIZE={local} ranks; "
            f"launch the same number of processes on every node (--nproc-per-node)"
        )
    device = device or default_device()
    memory = int(memory_bytes or device_memory(device, local))
    lk = links or Links.load()
    cluster = ClusterSpec(
        world_size=world,
        gpus_per_node=local,
        memory_bytes=memory,
        intra_bw=lk.intra_bw,
        intra_latency=lk.intra_latency,
        inter_bw=lk.inter_bw,
        inter_latency=lk.inter_latency,
        name=f"{device.type}x{world}",
    )
    if num_heads is not None:
        check_launch(cluster, num_heads)
    return cluster


def check_launch(cluster: ClusterSpec, num_heads: int) -> None:
    """A clear error when the model's heads leave the planners no SP degree but 1 on a
    launch of several ranks (no sample could ever be split over ranks); never with the
    cluster's `ring` (Ulysses x ring groups need not divide the heads)."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1; got {num_heads}")
    if cluster.world_size > 1 and group_sizes(cluster, num_heads, cluster.ring) == [1]:
        g = cluster.gpus_per_node
        cands = sorted({k for k in range(2, cluster.world_size + 1) if g % k == 0 or k % g == 0})
        raise ValueError(
            f"{num_heads} attention heads: no SP degree of this launch (world {cluster.world_size}, "
            f"{g} ranks per node: {cands}) divides them, so no sample can be split over ranks; use a head "
            f"count divisible by one of those, ring attention (ring=True), or train with plain data parallelism"
        )


# ---------------------------------------------------------------- failure of one rank


def abort_on_oom(exc: BaseException, *, step: int, epoch: int, layout, ranks, sample_ids, seq_len: int) -> None:
    """An out-of-memory error in a planned micro-batch. With several ranks this process
    exits at once (status `OOM_EXIT_CODE`) after printing what failed: its SP group's peers
    would otherwise wait in an all-to-all until the collective timeout. The launcher
    (torchrun, Slurm) then ends the other ranks; gloo peers also fail on the closed
    connection. On one rank it raises instead."""
    from dcparallel.runtime import comm

    rank = comm.world_rank()
    rc = layout.recompute
    msg = (
        f"rank {rank}: out of memory in step {step} (epoch {epoch}), micro-batch layout sp={layout.sp} "
        f"mbs={layout.mbs} recompute attn={rc.attn} mlp={rc.mlp} on ranks {tuple(ranks)}, samples "
        f"{tuple(sample_ids)} ({seq_len} tokens a row): the plan's memory estimate was too low for this "
        f"device; lower the memory budget (memory_mib / memory_bytes) or re-profile. Ending every rank. "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    )
    if comm.world_size() == 1:
        raise torch.OutOfMemoryError(msg) from exc
    print(f"[dcparallel] {msg}", file=sys.stderr, flush=True)
    log.critical(msg)
    _record_oom()
    sys.stdout.flush()
    os._exit(OOM_EXIT_CODE)


# ---------------------------------------------------------------- the budget after an OOM exit

_oom_dir: list[Path] = []


def record_ooms_in(directory: str | Path) -> None:
    """Where `abort_on_oom` leaves one file per failed attempt (the run's out_dir): the
    restarted run counts them (`oom_restarts`) and plans with a lower budget instead of
    replaying the plan that ran out of memory."""
    _oom_dir[:] = [Path(directory)]


def _record_oom() -> None:
    if not _oom_dir:
        return
    # one name per (launch, attempt): every rank that failed in this attempt writes the same file
    name = f"oom-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-attempt{restart_attempt()}"
    try:
        (_oom_dir[0] / name).touch()
    except OSError as exc:
        print(f"[dcparallel] could not record the out-of-memory exit in {_oom_dir[0]}: {exc}", file=sys.stderr)


def oom_restarts(directory: str | Path) -> int:
    """How many attempts of runs in ``directory`` ended out of memory (delete its oom-* files
    to plan with the whole budget again)."""
    return len(list(Path(directory).glob("oom-*-attempt*")))


def oom_budget(memory_bytes: int, num_ooms: int) -> int:
    """The memory budget after ``num_ooms`` out-of-memory exits: `OOM_BUDGET_FACTOR` each."""
    return int(memory_bytes * OOM_BUDGET_FACTOR**num_ooms)
