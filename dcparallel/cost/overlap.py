"""How much of the step's gradient sync the last backward hides (runtime/grad_sync.py).

The runtime reduces the flat fp32 gradients in fixed buckets, launched during each rank's
last backward as they become final; a rank with no work launches them all at once. The
all-reduce finishes no earlier than the last rank to reach the sync allows, so what is
exposed after the last rank's compute is the sync time its last backward could not hide,
and never less than the last bucket (its gradients — the first layers' — are final only
when that backward ends):

    exposed = max(sync - BACKWARD_FRACTION * last_micro_batch_time, sync / num_buckets)

BACKWARD_FRACTION: backward is about twice the forward (2 of fwd + bwd = 3); a backward with
recomputation is longer, so 2/3 slightly under-counts what it hides (conservative).
"""

from __future__ import annotations

import math

import numpy as np

BACKWARD_FRACTION = 2.0 / 3.0

# The runtime's default bucket size (`default_bucket_bytes`; runtime.grad_sync takes it from
# here). A bucket is one all-reduce; a ring all-reduce of b bytes over W ranks takes about
# 2 (W - 1) alpha + 2 (W - 1) / W * b / beta, so its latency part is W alpha beta / b of its
# bandwidth part. Three lower bounds on the size, the largest wins:
#: DDP's bucket: big enough to reach a link's bandwidth, small enough to overlap
MIN_BUCKET_BYTES = 25 * 2**20
#: at most this many sequential all-reduces per step, whatever the model: a 7B model's 28 GB
#: of fp32 gradients in 25 MiB buckets would be about 1000 launches, each paying the latency
MAX_BUCKETS = 64
#: bytes per rank of the world that keep the latency part <= 10%: W alpha beta / 0.1 with an
#: inter-node step of alpha = 20 us at beta = 40 GB/s (`spec.h200_cluster`'s links), 8 MB a
#: rank: 25 MiB up to 3 ranks, 64 MB at 8, 8.2 GB at 1024 (a 7B model then has 4 buckets)
BUCKET_BYTES_PER_RANK = 8 * 10**6
#: the bucket the cost model's `num_buckets` assumes when given none
BUCKET_BYTES = MIN_BUCKET_BYTES


def default_bucket_bytes(buffer_bytes: float, world_size: int) -> int:
    """The runtime's default bucket size for a flat fp32 gradient buffer of ``buffer_bytes``
    all-reduced over ``world_size`` ranks (a multiple of 4 bytes: whole fp32 elements)."""
    size = max(MIN_BUCKET_BYTES, math.ceil(buffer_bytes / MAX_BUCKETS), world_size * BUCKET_BYTES_PER_RANK)
    return 4 * math.ceil(size / 4)


def num_buckets(num_params: float, bucket_bytes: int = BUCKET_BYTES) -> int:
    return max(1, math.ceil((4.0 * num_params + 8) / bucket_bytes))


def sync_buckets(num_params: float, shard_size: int = 1, world_size: int = 1) -> int:
    """The buckets of a rank's gradient sync: its 1/shard_size of the flat fp32 gradients,
    all-reduced over the world_size / shard_size replicas, in the runtime's default buckets."""
    buffer = 4.0 * num_params / shard_size + 8
    return num_buckets(num_params / shard_size, default_bucket_bytes(buffer, max(1, world_size // shard_size)))


def exposed_sync(sync_s: float, last_micro_batch_s: float, buckets: int) -> float:
    """Sync time left after the critical rank's compute (``last_micro_batch_s``: forward +
    backward of its last micro-batch; 0 when overlap is off or it ran nothing)."""
    if sync_s <= 0:
        return 0.0
    return max(sync_s - BACKWARD_FRACTION * last_micro_batch_s, sync_s / buckets)


def exposed_sync_many(sync_s: float, last_micro_batch_s: np.ndarray, buckets: int) -> np.ndarray:
    """`exposed_sync` for each of an array of last micro-batch times."""
    if sync_s <= 0:
        return np.zeros_like(last_micro_batch_s)
    return np.maximum(sync_s - BACKWARD_FRACTION * last_micro_batch_s, sync_s / buckets)
