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
#: the runtime's default bucket (runtime.grad_sync.DEFAULT_BUCKET_BYTES; no torch import here)
BUCKET_BYTES = 25 * 2**20


def num_buckets(num_params: float, bucket_bytes: int = BUCKET_BYTES) -> int:
    return max(1, math.ceil((4.0 * num_params + 8) / bucket_bytes))


def sync_buckets(num_params: float, shard_size: int = 1) -> int:
    """The buckets of a rank's gradient sync: its 1/shard_size of the flat fp32 gradients."""
    return num_buckets(num_params / shard_size)


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
