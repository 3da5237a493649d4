"""The links of a CPU launch timed for ``cost = "analytic"`` (`profile.cpu_calibration`).

The analytic model prices an all-to-all in a group of n ranks holding b bytes each as
``latency * (n - 1) + b * (n - 1) / n / bw`` (`cost.base.alltoall_time`); the gradient sync
is priced from the same link. A launch without link speeds gets GPU ones
(`runtime.auto_launch.priced_cluster`), a thousand times too fast for gloo on one machine.
Here every rank runs ``all_to_all_single`` over the launch's world at two sizes (64 KiB and
4 MiB a rank; each the median of five windows of at least 0.1 s, each window from a barrier,
so a burst of other work on a shared machine moves one window, not the result), each call
after 10 ms of matrix work on every rank and a barrier, as the runtime makes them between a
layer's computations: what a call costs then, which a tight loop of calls does not see (the
wait for a late rank, which a shared machine's scheduler makes, is not timed: it is not the
link's). The slowest rank's times give
the latency (intercept) and bandwidth (slope) of that formula, used for both the intra- and
inter-node link of the cluster the CPU run is priced on. About 1.5 s; cached with the
calibration. A world of one rank has no links to time.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch
import torch.distributed as dist

from dcparallel.runtime import comm
from dcparallel.spec import ClusterSpec

#: bytes each rank holds in the two timed all-to-alls
TIMED_BYTES = (64 * 1024, 4 * 1024 * 1024)
#: windows each size is timed in, and the least seconds of one (`_timed_alltoall`)
REPEATS, MIN_S = 5, 0.1
#: processor seconds of matrix work each rank does before every timed call: the runtime makes
#: its all-to-alls between a layer's computations, never back to back, and such a call costs
#: more than one of a tight loop (the demo's SP 2 micro-batches: 2.2 ms a call once both ranks
#: were in it, against 0.65 ms priced from back-to-back calls)
COMPUTE_S = 0.01


def fit_link(n: int, timed: list[tuple[float, float]]) -> dict:
    """Latency (s per step) and bandwidth (bytes/s) of `cost.base.alltoall_time`'s formula
    through two (bytes per rank, seconds) timings of an all-to-all among ``n`` ranks: the
    slope gives the bandwidth, the intercept the latency (never below 0; a slope no larger
    than 0, timing noise, takes the larger timing as all bandwidth)."""
    (b1, t1), (b2, t2) = sorted(timed)
    share = (n - 1) / n
    slope = (t2 - t1) / (b2 - b1)
    bw = share / slope if slope > 0 else share * b2 / t2
    latency = max(0.0, (t1 - share * b1 / bw) / (n - 1))
    return {"bw": bw, "latency": latency}


def _compute(seconds: float) -> None:
    """Matrix work on this thread until its processor clock has advanced ``seconds``."""
    a = torch.ones(128, 128)
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        a @ a


def _timed_alltoall(num_bytes: int) -> float:
    """Seconds of one all-to-all of ``num_bytes`` a rank (collective) as the runtime makes
    them: each call after `COMPUTE_S` processor seconds of matrix work on every rank and a
    barrier (every rank in the call at once: the wait for a late rank is not timed); the
    median over `REPEATS` windows, each from a barrier, of the mean of a run of calls lasting
    at least `MIN_S` on the slowest rank (every rank makes the same number: the slowest
    rank's single call and compute after a warm-up set it)."""
    n = comm.world_size()
    x = torch.zeros(num_bytes // 4 // n * n, dtype=torch.float32)
    y = torch.empty_like(x)

    def window(calls: int) -> tuple[float, float]:
        dist.barrier()
        spent, t0 = 0.0, time.perf_counter()
        for _ in range(calls):
            _compute(COMPUTE_S)
            dist.barrier()  # the wait for the slowest rank is not the link's
            t1 = time.perf_counter()
            dist.all_to_all_single(y, x)
            spent += time.perf_counter() - t1
        return spent / calls, (time.perf_counter() - t0) / calls

    window(1)  # warm-up
    one = max(comm.all_gather_object(window(1)[1]))
    calls = max(2, math.ceil(MIN_S / max(one, 1e-9)))
    return statistics.median(window(calls)[0] for _ in range(REPEATS))


def measure_links() -> dict:
    """This launch's link, timed on every rank at once (collective): `fit_link` of the
    slowest rank's timings."""
    mine = [(float(b), _timed_alltoall(b)) for b in TIMED_BYTES]
    every = comm.all_gather_object(mine)
    slowest = [(b, max(r[i][1] for r in every)) for i, (b, _) in enumerate(mine)]
    return fit_link(comm.world_size(), slowest)


def with_links(cluster: ClusterSpec, link: dict) -> ClusterSpec:
    """``cluster`` with ``link``'s bandwidth and latency for every link."""
    return dataclasses.replace(
        cluster, intra_bw=link["bw"], inter_bw=link["bw"], intra_latency=link["latency"], inter_latency=link["latency"]
    )
