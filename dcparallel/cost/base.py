"""The cost-model protocol and the pieces every cost model shares.

A cost model answers: how long does one micro-batch (its samples, on a group of `sp`
ranks, with a recompute setting) take forward + backward, and how much memory does each
rank of its group peak at. Every cost model reduces a micro-batch to `MicroBatchTerms`,
which is linear in the recompute counts; time and memory of any `Recompute` and the PAC
knapsack all come from those terms, so both cost models share one definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from dcparallel.cost.batch import Batches, TermsArray
from dcparallel.spec import ClusterSpec, Layout, ModelSpec, Recompute, Size


@dataclass(frozen=True, slots=True)
class MicroBatchTerms:
    """Time and memory of one micro-batch on one group, as linear functions of recompute.

    With f = min(attn, mlp) layers recomputing both sub-blocks:
      time   = time_none + f*dt_full + (attn-f)*dt_attn + (mlp-f)*dt_mlp
      memory = fixed + L*act_layer - f*save_full - (attn-f)*save_attn - (mlp-f)*save_mlp
               + (transient_none if nothing recomputes else transient_rec)
    """

    num_layers: int
    time_none: float
    dt_attn: float
    dt_mlp: float
    dt_full: float
    fixed_bytes: float
    act_layer: float
    save_attn: float
    save_mlp: float
    save_full: float
    transient_none: float
    transient_rec: float
    #: False when only full recomputation was ever seen to fit (a profile with no other
    #: measurement): every other setting is then reported as not fitting any budget
    keep_all_feasible: bool = True

    def time(self, r: Recompute) -> float:
        a, m = min(r.attn, self.num_layers), min(r.mlp, self.num_layers)
        f = min(a, m)
        return self.time_none + f * self.dt_full + (a - f) * self.dt_attn + (m - f) * self.dt_mlp

    def memory(self, r: Recompute) -> float:
        a, m = min(r.attn, self.num_layers), min(r.mlp, self.num_layers)
        f = min(a, m)
        if not self.keep_all_feasible and f < self.num_layers:
            return float("inf")
        saved = f * self.save_full + (a - f) * self.save_attn + (m - f) * self.save_mlp
        transient = self.transient_none if a == 0 and m == 0 else self.transient_rec
        return self.fixed_bytes + self.num_layers * self.act_layer - saved + transient

    def cheapest_recompute(self, budget: float) -> Recompute | None:
        """PAC's knapsack: the recompute counts (attn, mlp) of least time whose memory fits
        `budget`, or None if even full recomputation does not fit.

        Layers are identical, so a choice is f layers recomputing both sub-blocks plus x
        layers recomputing one kind (attention-only or MLP-only: the runtime recomputes
        attention in layers 0..attn-1 and the MLP in 0..mlp-1, so only one kind can extend
        past the overlap). For each f the fewest x that fit is a division: O(L)."""
        L = self.num_layers
        none = Recompute(0, 0)
        if self.memory(none) <= budget:
            return none
        if not self.keep_all_feasible:
            full = Recompute(L, L)
            return full if self.memory(full) <= budget else None
        need = self.fixed_bytes + L * self.act_layer + self.transient_rec - budget  # bytes to save
        best_t, best = math.inf, None
        sf, tf = self.save_full, self.dt_full
        for save, dt, kind in ((self.save_attn, self.dt_attn, 0), (self.save_mlp, self.dt_mlp, 1)):
            for f in range(_first_fit(need, sf, save, L), L + 1):
                rest = need - f * sf
                if rest <= 0:
                    x = 0 if f > 0 else 1  # f = x = 0 is keeping everything, which did not fit
                    if f == 0 and save <= 0:
                        continue
                elif save <= 0:
                    continue
                else:
                    x = max(1, math.ceil(rest / save - 1e-9))
                if f + x > L:
                    continue
                t = f * tf + x * dt
                if t < best_t - 1e-15:
                    best_t, best = t, (f, x, kind)
                if rest <= 0:
                    break  # more full layers only add time
        if best is None:
            return None
        f, x, kind = best
        r = Recompute(f + x, f) if kind == 0 else Recompute(f, f + x)
        if self.memory(r) > budget:  # rounding at the boundary: one more layer of that kind
            r2 = Recompute(r.attn + (kind == 0), r.mlp + (kind == 1))
            if max(r2.attn, r2.mlp) > L or self.memory(r2) > budget:
                full = Recompute(L, L)
                return full if self.memory(full) <= budget else None
            r = r2
        return r


def _first_fit(need: float, sf: float, save: float, L: int) -> int:
    """Where `cheapest_recompute`'s scan over f (layers recomputing both sub-blocks) can start:
    every smaller f is skipped there (f + x > L) without touching the best choice, so starting
    here gives the same answer in fewer steps (most f are such when much memory must be saved).

    With rest = need - f * sf > 0 the scan takes x >= rest / save - 1e-9 layers of one kind,
    so f + x >= need / save - 1e-9 - f * (sf / save - 1), above L for every f below
    F = (need / save - L - 1e-9) / (sf / save - 1) when full layers save more (sf > save).
    Two layers of margin (F - 2 leaves f + x above L by 2 (sf / save - 1) >= 2e-6, far beyond
    float rounding), and never past need / sf - 2 (where rest <= 0 would end the scan)."""
    if not (save > 0 and sf > save * (1 + 1e-6)):
        return 0
    first = (need / save - L - 1e-9) / (sf / save - 1)
    return max(0, int(min(first, need / sf, L)) - 2)


class CostModel(Protocol):
    """Time and per-rank peak memory of one micro-batch for a layout."""

    model: ModelSpec
    cluster: ClusterSpec
    #: the SP degrees this model can price (a profile measured only some); None = any degree
    sp_sizes: Sequence[int] | None

    def terms(self, sizes: Sequence[Size], sp: int) -> MicroBatchTerms: ...

    def terms_copies(self, size: Size, count: int, sp: int) -> MicroBatchTerms: ...

    def terms_grid(self, batches: Batches, sps: Sequence[int]) -> TermsArray:
        """`terms` of every micro-batch at every degree, as arrays of shape (len(batches),
        len(sps)), each element equal to the scalar `terms` (`cost.batch`)."""
        ...

    def terms_copies_grid(self, sizes: Sequence[Size], counts: np.ndarray, sp: int) -> TermsArray:
        """`terms_copies(sizes[i], counts[i], sp)` of every i, as arrays of shape (len(counts),
        1), each element equal to the scalar `terms_copies`."""
        ...

    def grad_sync_time(self) -> float: ...

    def model_state_bytes(self) -> float: ...


#: per-micro-batch caches are emptied past this many entries: planning every step of a long
#: run meets ever new micro-batches (text lengths rarely repeat), and a cache that only grows leaks
CACHE_LIMIT = 100_000


def cache_put(cache: dict, key, value):
    """Stores `value` under `key` in a per-micro-batch cache bounded by `CACHE_LIMIT`; returns it."""
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def mb_time(cost: CostModel, sizes: Sequence[Size], layout: Layout) -> float:
    """Forward + backward seconds of one micro-batch on its group, communication included."""
    return cost.terms(sizes, layout.sp).time(layout.recompute)


def mb_memory(cost: CostModel, sizes: Sequence[Size], layout: Layout) -> float:
    """Peak bytes on each rank of the group: model states + activations + transients."""
    return cost.terms(sizes, layout.sp).memory(layout.recompute)


#: elements per chunk of the optimizer step (`runtime.zero`, `runtime.sharded_optim`): the
#: step's fp32 temporaries (the Adam denominator, the replicas' gathered pieces) are one chunk
#: each, not a copy of the shard. 16 MiB of fp32: a few hundred kernels per step at 7B.
STEP_CHUNK_NUMEL = 2**22


@dataclass(frozen=True, slots=True)
class StateRecipe:
    """Bytes per rank the runtime holds for the model, by part (`state_recipe`).

    ``params``: the parameters this rank stores; ``grads``: its fp32 gradient buffer;
    ``optimizer``: its fp32 master weights (where the parameters are not them) and Adam
    moments; ``gathered``: whole parameters a micro-batch gathers (shard blocks only, during
    the micro-batches); ``step_transient``: the peak of sync + clip + optimizer step on top of
    the states (the activations are freed by then); ``held``: whole fp32 gradients FSDP keeps
    between a shard block's micro-batches (`unsharded_grad_bytes`; reduce-scattered and freed
    by the last micro-batch's backward, so not in the step); ``autocast``: the 16-bit copies of
    the fp32 weights a forward under autocast casts (`ModelSpec.autocast_params`, 2 bytes each:
    `runtime.autocast`), held through each micro-batch, freed before the step."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    step_transient: float
    held: float = 0.0
    autocast: float = 0.0

    @property
    def states(self) -> float:
        """What every micro-batch finds allocated: the planner's fixed bytes per rank."""
        return self.params + self.grads + self.optimizer + self.gathered + self.held + self.autocast

    @property
    def step_peak(self) -> float:
        """Peak bytes of the step's sync, clip and optimizer update."""
        return self.params + self.grads + self.optimizer + self.step_transient


def state_recipe(
    model: ModelSpec,
    world_size: int,
    shard_size: int = 1,
    *,
    num_params: float | None = None,
    bytes_per_value: float | None = None,
    frozen_params: float | None = None,
    trainable_bytes: float | None = None,
    unsharded_grads: bool = False,
) -> StateRecipe:
    """The runtime's memory recipe per rank (b = the model's `bytes_per_value`, T trainable and
    F frozen parameters, P = T + F, W ranks, s the shard size), as `runtime.zero` /
    `runtime.sharded` allocate it. Frozen parameters (``requires_grad=False``) are stored
    only: no gradient, no master weight, no moments.

    Shard size 1 (ZeRO-1): parameters (b P; the trainable ones at ``trainable_bytes``, default
    b: fp32 adapters on a bf16 base) and the fp32 gradient buffer (4 T) on every rank; fp32
    master weights (4 T / W, none when the trainable parameters are fp32: they are the master)
    and both moments (8 T / W). The gradient buffer stays whole: micro-batches accumulate into
    all of it, though the sync sums only this rank's shard. The step: the sync and the clip
    work in place (no low-precision ``p.grad`` copies), the parameter all-gather writes into
    the flat buffer itself, and the update's one temporary is a chunk of `STEP_CHUNK_NUMEL`
    fp32 values.

    Shard size s > 1 (`runtime.sharded`): fp32 trainable parameter shards, which are the master
    weights (4 T / s), frozen shards in the model's dtype (b F / s), fp32 gradient shards
    (4 T / s), moments over the world (8 T / W) and the whole parameters each micro-batch
    gathers (`gathered_bytes`). The step: the replica all-reduce and the clip in place; the
    update reads and writes the parameter shards one chunk at a time: its denominator and the
    replicas' gathered chunks, this rank's among them (1 + W / s chunks). ``unsharded_grads``
    (s > 1): FSDP holds the step's gradients whole between micro-batches
    (`runtime.sharded.ShardedGrads.set_accumulate_unsharded`): ``held`` = 4 T (fp32,
    `unsharded_grad_bytes`). ``num_params`` / ``bytes_per_value`` / ``frozen_params``: counts
    of a built model where they differ from the spec's (the profiler's)."""
    total = float(model.num_params if num_params is None else num_params)
    f = float(model.frozen_params if frozen_params is None else frozen_params)
    p = total - f  # trainable
    b = float(model.bytes_per_value if bytes_per_value is None else bytes_per_value)
    bt = b if trainable_bytes is None else float(trainable_bytes)
    w, s = world_size, shard_size
    chunk = 4.0 * min(STEP_CHUNK_NUMEL, math.ceil(p / w))  # the optimizer's piece is about T / W
    cast = 2.0 * model.autocast_params
    if s == 1:
        master = 0.0 if bt >= 4 else 4 * p / w
        return StateRecipe(
            params=bt * p + b * f,
            grads=4 * p,
            optimizer=master + 8 * p / w,
            gathered=0.0,
            step_transient=chunk,
            autocast=cast,
        )
    return StateRecipe(
        params=(4 * p + b * f) / s,
        grads=4 * p / s,
        optimizer=8 * p / w,
        gathered=gathered_bytes(model),
        step_transient=(1 + w // s) * chunk,
        held=4 * p if unsharded_grads else 0.0,
        autocast=cast,
    )


def unsharded_grad_bytes(model: ModelSpec) -> float:
    """What FSDP holds per rank while a shard block's gradients accumulate whole between
    micro-batches: every trainable parameter's gradient in fp32 (a low-precision model's
    gradients are kept in the fp32 reduce dtype)."""
    return 4.0 * model.trainable_params


def model_state_bytes(model: ModelSpec, world_size: int, shard_size: int = 1) -> float:
    """The model states per rank of `state_recipe`: what every micro-batch finds allocated."""
    return state_recipe(model, world_size, shard_size).states


def gathered_bytes(model: ModelSpec) -> float:
    """Peak bytes of whole (gathered) parameters and their unsharded gradients on a rank of a
    shard block, per FSDP2's order of work: the parameters outside the repeated layers
    (embeddings, head: the root unit) stay gathered for the whole micro-batch, bf16, and so does
    their bf16 gradient from the head's backward to the end; of the largest layer, its bf16
    parameters twice (the layer running and the next one prefetched) and, in backward, its
    unsharded gradient in bf16 plus the fp32 copy the reduce-scatter sums (6 bytes). (bf16
    stands for the model's `bytes_per_value`.) Frozen parameters get no gradient: the
    gradients are counted for the trainable share of the parameters only."""
    b = model.bytes_per_value
    share = model.trainable_params / model.num_params if model.num_params else 1.0
    return b * model.extra_params * (1 + share) + (2 * b + (b + 4) * share) * model.unit_params


def allreduce_time(cluster: ClusterSpec, num_bytes: float) -> float:
    """Hierarchical ring all-reduce: reduce-scatter + all-gather inside each node over
    NVLink, then a ring all-reduce of each GPU's 1/g shard across nodes."""
    return _two_level_allreduce(cluster, num_bytes, min(cluster.gpus_per_node, cluster.world_size), cluster.num_nodes)


def _two_level_allreduce(cluster: ClusterSpec, num_bytes: float, local: int, nodes: int) -> float:
    """Ring all-reduce of ``num_bytes`` per rank among ``local`` ranks in each of ``nodes``
    nodes: inside each node over NVLink, then a ring of each rank's 1/local part across nodes."""
    t = 0.0
    if local > 1:
        t += 2 * (local - 1) / local * num_bytes / cluster.intra_bw + 2 * (local - 1) * cluster.intra_latency
    if nodes > 1:
        t += 2 * (nodes - 1) / nodes * (num_bytes / local) / cluster.inter_bw + 2 * (nodes - 1) * cluster.inter_latency
    return t


def grad_sync_time(model: ModelSpec, cluster: ClusterSpec) -> float:
    """The once-per-step gradient sync (trainable parameters only). Shard size 1 (ZeRO-1,
    `runtime.zero`): each bucket of the flat fp32 gradients is reduced into the rank that owns
    its shard — together a reduce-scatter, half an all-reduce's ring traffic — and the updated
    parameters (in the model's dtype) are all-gathered after the step, half an all-reduce of
    theirs. Shard blocks of s > 1 ranks: the all-reduce of each rank's 1/s of the gradients
    over the W/s replicas of its shard (`replica_sync_time`)."""
    if cluster.world_size == 1:
        return 0.0
    if cluster.shard_size > 1:
        return replica_sync_time(cluster, 4.0 * model.trainable_params / cluster.shard_size)
    t = model.trainable_params
    return (allreduce_time(cluster, 4.0 * t) + allreduce_time(cluster, model.bytes_per_value * t)) / 2


def replica_sync_time(cluster: ClusterSpec, num_bytes: float) -> float:
    """All-reduce of ``num_bytes`` per rank among the ranks that hold the same shard: one rank
    in each block of s, so g / s of them in a node (s < g GPUs per node) or one in every s / g
    nodes. Hierarchical as `allreduce_time`: inside each node over NVLink, then a ring of each
    rank's part across nodes."""
    s, g = cluster.shard_size, min(cluster.gpus_per_node, cluster.world_size)
    replicas = cluster.world_size // s
    local = max(1, g // s)  # replicas of one shard inside a node
    return _two_level_allreduce(cluster, num_bytes, local, replicas // local)  # the nodes the replicas span


def block_collective_time(cluster: ClusterSpec, num_bytes: float) -> float:
    """A ring all-gather (or reduce-scatter) inside one shard block: each rank receives (sends)
    (s - 1) / s of ``num_bytes`` (the whole tensor), over NVLink inside a node and over the
    inter-node link for a block larger than a node (conservative, as `alltoall_time`)."""
    return _group_exchange_time(cluster, cluster.shard_size, num_bytes)


def alltoall_time(cluster: ClusterSpec, sp: int, bytes_per_rank: float) -> float:
    """One Ulysses all-to-all in a group of `sp` ranks where each rank holds
    `bytes_per_rank` and sends (sp - 1) / sp of it; a group larger than a node pays the
    inter-node link for all of it (conservative)."""
    return _group_exchange_time(cluster, sp, bytes_per_rank)


def _group_exchange_time(cluster: ClusterSpec, n: int, num_bytes: float) -> float:
    """A collective inside a group of ``n`` ranks in which each rank exchanges (n - 1) / n of
    ``num_bytes`` in n - 1 steps: over NVLink inside a node, over the inter-node link for a
    group larger than a node."""
    if n == 1:
        return 0.0
    if cluster.spans_nodes(n):
        return _exchange(cluster.inter_latency, cluster.inter_bw, n, num_bytes)
    return _exchange(cluster.intra_latency, cluster.intra_bw, n, num_bytes)


def _exchange(latency: float, bw: float, n, num_bytes):
    """n - 1 steps of `latency` and (n - 1) / n of `num_bytes` over `bw` (floats or arrays)."""
    return latency * (n - 1) + num_bytes * (n - 1) / n / bw


def alltoall_time_many(cluster: ClusterSpec, sp: np.ndarray, bytes_per_rank: np.ndarray) -> np.ndarray:
    """`alltoall_time` elementwise over arrays of degrees and bytes (broadcast), by the same
    operations."""
    inter = _exchange(cluster.inter_latency, cluster.inter_bw, sp, bytes_per_rank)
    intra = _exchange(cluster.intra_latency, cluster.intra_bw, sp, bytes_per_rank)
    return np.where(sp == 1, 0.0, np.where(cluster.spans_nodes(sp), inter, intra))
