"""AnalyticCost: FLOPs over fitted compute rates, bytes over link bandwidths.

Per layer and rank, a micro-batch of N tokens with P attention query-key pairs on a group
of `sp` ranks costs

    compute = smoothmax_p(floor, N/sp * lin_s_per_token + P/sp * attn_s_per_pair)

forward + backward: linear work is proportional to tokens, attention work to the pairs of
the model's attention pattern (causal 1D, full 3D, factorized spatial/temporal), and short
micro-batches are launch-bound (the `floor`: on an H200 a DiT block at 256 tokens runs
74k tok/s at batch 1 and 2.56M tok/s at batch 64). Recomputing a sub-block adds a fitted
fraction of its compute. Memory per token and layer is split into what the attention
sub-block keeps, what the MLP keeps, and the rest; backward's peak on top of it (the loss's
or one layer's gradients in flight) comes from the model's shapes (`cost.backward_memory`).
All constants are fitted to the H200
calibration files in `dcparallel/calibration/` (see `fit_calibration`); a model other than
the calibrated block is scaled by its FLOPs per token and its hidden sizes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dcparallel.cost.backward_memory import activation_bytes, layer_backward_bytes, output_head_bytes
from dcparallel.cost.base import (
    MicroBatchTerms,
    alltoall_time,
    alltoall_time_many,
    cache_put,
    grad_sync_time,
    model_state_bytes,
)
from dcparallel.cost.batch import Batches, TermsArray, exact_pow, sequential_sums
from dcparallel.cost.calibration_fit import Calibration, _attn_share, _layer_params, _smoothmax, fit_calibration
from dcparallel.cost.heads import layer_a2a_calls, layer_a2a_units
from dcparallel.cost.ring import SplitTime, best_split, check_ring, layer_comm
from dcparallel.cost.shard import ShardComm
from dcparallel.cost.vision import VisionTable, sample_vision, vision_price
from dcparallel.spec import ClusterSpec, ModelSpec, Size


def _smoothmax_many(floor: float, compute: np.ndarray, p: float) -> np.ndarray:
    """`_smoothmax` elementwise, bit for bit (`cost.batch.exact_pow`)."""
    return exact_pow(floor**p + exact_pow(compute, p), 1.0 / p)


def _pairs(model: ModelSpec, size: Size) -> float:
    return float(model.attention_pairs(size))


def _weight_work(model: ModelSpec) -> float:
    """The share of the calibrated linear work (forward, input gradient and weight gradient:
    three equal matmuls per weight) left when frozen weights skip their weight gradient."""
    return 1.0 - model.frozen_params / model.num_params / 3.0 if model.num_params else 1.0


class AnalyticCost:
    """Cost model from a `Calibration` scaled to `model`, on `cluster`.

    Scaling: linear time by the layer's FLOPs per token (weights touched per token; a frozen
    weight computes no weight gradient, a third of its work: `_weight_work`),
    attention time by hidden size and attention sub-blocks, memory by hidden size (the
    MLP's kept activations by the FFN and hidden widths, all by the bytes of an activation
    value). For the calibrated block itself the factors are 1. Text models add what the
    output head keeps and the loss's backward holds (`cost.backward_memory`).
    With shard blocks (`ClusterSpec.shard_size` > 1) the states are sharded
    (`base.model_state_bytes`) and each micro-batch pays its block's collectives (`cost.shard`).
    """

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        calibration: Calibration | None = None,
        vision_table: VisionTable | None = None,
    ):
        if cluster.world_size > 1 and cluster.intra_bw <= 0 or cluster.num_nodes > 1 and cluster.inter_bw <= 0:
            raise ValueError(
                f"cluster {cluster.name!r} has no link bandwidth (intra_bw={cluster.intra_bw}, "
                f"inter_bw={cluster.inter_bw}); AnalyticCost needs both to price all-to-alls and the "
                f"gradient all-reduce: use spec.h200_cluster(...) or set them in bytes/s"
            )
        #: the packaged calibration fitted (`cost.provenance`); None: the caller's ``calibration``
        self.calibration_name = (
            None if calibration is not None else "stdit-1.1b" if model.kind == "video" else "llama-7b"
        )
        if calibration is None:
            calibration = fit_calibration(self.calibration_name)
        self.model, self.cluster, self.cal = model, cluster, calibration
        check_ring(model, cluster)
        self.sp_sizes = None  # the analytic model prices any SP degree
        ref = calibration.ref
        self._lin = calibration.lin_s_per_token * _layer_params(model) / _layer_params(ref) * _weight_work(model)
        self._attn = (
            calibration.attn_s_per_pair * (model.hidden * model.attn_per_layer) / (ref.hidden * ref.attn_per_layer)
        )
        self._share = _attn_share(model)
        # each further document's attention calls (a video micro-batch stacks its samples as
        # rows of one call): on a kernel that calls once per document (`Calibration.attn_call_s`)
        self._per_document = calibration.attn_calls_per_document and model.kind != "video"
        self._doc_call = calibration.attn_call_s * model.attn_per_layer if self._per_document else 0.0
        # a text document's pairs priced at its length's cost per pair (`Calibration.attn_knots`)
        knots = calibration.attn_knots if model.kind == "text" else ()
        self._knots = (np.log2([k[0] for k in knots]), np.array([k[1] for k in knots])) if knots else None
        # kept bytes scale with the widths and the bytes of an activation value (fp32 keeps twice
        # bf16's); the MLP keeps ffn- and hidden-wide values alike (a gated MLP: its input, the
        # gate's and the up projection's outputs, the activation's, their product)
        ab = activation_bytes(model) / activation_bytes(ref)
        dr = model.hidden / ref.hidden * ab
        fr = (model.ffn_hidden + model.hidden) / (ref.ffn_hidden + ref.hidden) * ab
        self._act_attn = calibration.act_attn * dr
        self._act_mlp = calibration.act_mlp * fr
        self._act_rest = calibration.act_rest * dr
        self._act_full = calibration.act_full * dr
        self._act_sample = calibration.act_per_sample * dr
        self._state = model_state_bytes(model, cluster.world_size, cluster.shard_size)
        self._shard = ShardComm.of(model, cluster) if cluster.shard_size > 1 else None
        self._sync = grad_sync_time(model, cluster)
        # the output head of a text model: linear work per token outside the layers
        self._head_s_per_token = (
            (calibration.lin_s_per_token / _layer_params(ref)) * (model.vocab_size * model.hidden) * _weight_work(model)
        )
        # a vision-language model's tower: measured (``vision_table``, `profile.vision`), else scaled
        # from the same calibration (`cost.vision`)
        self._vision = vision_price(
            model,
            vision_table,
            calibration.lin_s_per_token / _layer_params(ref),
            calibration.attn_s_per_pair / ref.hidden,
            (calibration.act_attn + calibration.act_mlp + calibration.act_rest) / ref.hidden,
        )
        self._cache: dict = {}
        self._stats: dict[Size, tuple] = {}  # per size: (tokens, attention pairs, `sample_vision`)

    def grad_sync_time(self) -> float:
        return self._sync

    def priced_pairs(self, tokens, pairs):
        """The attention pairs priced for documents of ``tokens`` tokens and ``pairs`` pairs
        (floats or arrays): ``pairs`` times the calibration's factor at that length
        (`Calibration.attn_knots`); ``pairs`` itself without knots."""
        if self._knots is None:
            return pairs
        return pairs * np.interp(np.log2(np.maximum(tokens, 1)), *self._knots)

    def attention_calls(self, n_samples: int) -> int:
        """The attention kernel calls priced per attention sub-block of a micro-batch of
        ``n_samples`` samples: one per document where the calibrated kernel calls once per
        document (`_fields` charges `Calibration.attn_call_s` for each beyond the first)."""
        return n_samples if self._per_document else 1

    def model_state_bytes(self) -> float:
        return self._state

    def best_split(self, sizes: Sequence[Size], sp: int) -> SplitTime:
        """The (Ulysses, ring) split of a group of `sp` ranks predicted fastest for a
        micro-batch of these samples: the least exposed communication (`cost.ring`)."""
        n = sum(self.model.tokens(s) for s in sizes)
        pairs = sum(float(self.priced_pairs(self.model.tokens(s), _pairs(self.model, s))) for s in sizes)
        return best_split(self.model, self.cluster, sp, n, pairs, self._attn)

    def add_state_bytes(self, extra: float) -> None:
        """Bytes every micro-batch finds allocated on top of the model states counted so far
        (FSDP's whole gradients held between micro-batches: `cost.grad_hold`)."""
        self._state += float(extra)
        self._cache.clear()

    def terms(self, sizes: Sequence[Size], sp: int) -> MicroBatchTerms:
        n_tok = 0
        pairs = 0.0
        vis = [0, 0, 0, 0]
        stats = self._stats
        tower = self.model.vision
        for s in sizes:
            st = stats.get(s)
            if st is None:
                tok = self.model.tokens(s)
                st = stats[s] = (
                    tok,
                    float(self.priced_pairs(tok, _pairs(self.model, s))),
                    None if tower is None else sample_vision(tower, s),
                )
            n_tok += st[0]
            pairs += st[1]
            if st[2] is not None:
                v = st[2]
                vis = [vis[0] + v[0], vis[1] + v[1], max(vis[2], v[2]), max(vis[3], v[3])]
        return self._cached(n_tok, pairs, len(sizes), sp, tuple(vis))

    def terms_copies(self, size: Size, count: int, sp: int) -> MicroBatchTerms:
        """`terms` of a micro-batch of `count` copies of one size, in O(1)."""
        vis = (0, 0, 0, 0)
        if self.model.vision is not None:
            p, q, mp, mq = sample_vision(self.model.vision, size)
            vis = (count * p, count * q, mp, mq)
        tok = self.model.tokens(size)
        pairs = float(self.priced_pairs(tok, _pairs(self.model, size)))
        return self._cached(count * tok, count * pairs, count, sp, vis)

    def _cached(
        self, n_tok: int, pairs: float, n_samples: int, sp: int, vis: tuple[int, int, int, int]
    ) -> MicroBatchTerms:
        key = (n_tok, pairs, n_samples, sp, vis)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        fields = self._fields(n_tok, pairs, n_samples, sp, False, vis)
        return cache_put(self._cache, key, MicroBatchTerms(self.model.num_layers, *fields))

    def terms_grid(self, batches: Batches, sps: Sequence[int]) -> TermsArray:
        """`terms` of every micro-batch of `batches` at every degree of `sps`, as arrays of
        shape (len(batches), len(sps)): the same arithmetic on numpy arrays (`cost.batch`),
        each element equal to `terms` of that micro-batch at that degree. Not cached."""
        vis = None if self._vision is None else batches.vision_sums()
        pairs = batches.pair_sums()
        if self._knots is not None:
            pairs = sequential_sums(self.priced_pairs(batches.tokens, batches.pairs), batches.lengths)
        return self._grid(batches.token_sums(), pairs, batches.lengths, sps, vis)

    def terms_copies_grid(self, sizes: Sequence[Size], counts: np.ndarray, sp: int) -> TermsArray:
        """`terms_copies(sizes[i], counts[i], sp)` of every i, as arrays of shape (len(counts), 1),
        each element equal to it (the same arithmetic). Not cached."""
        counts = np.asarray(counts, dtype=np.int64)
        one = {s: (t := self.model.tokens(s), float(self.priced_pairs(t, _pairs(self.model, s)))) for s in set(sizes)}
        tok = np.fromiter((one[s][0] for s in sizes), dtype=np.int64, count=len(counts))
        pairs = np.fromiter((one[s][1] for s in sizes), dtype=float, count=len(counts))
        vis = None
        if self._vision is not None:
            p, q, mp, mq = np.array([sample_vision(self.model.vision, s) for s in sizes], dtype=np.int64).T
            vis = (counts * p, counts * q, mp, mq)
        return self._grid(counts * tok, counts * pairs, counts, [sp], vis)

    def _grid(
        self,
        n_tok: np.ndarray,
        pairs: np.ndarray,
        lengths: np.ndarray,
        sps: Sequence[int],
        vis: tuple[np.ndarray, ...] | None,
    ) -> TermsArray:
        """The terms of micro-batches of these token, pair and sample counts (and vision sums)
        at every degree of `sps`, as arrays of shape (micro-batches, degrees)."""
        assert n_tok.max(initial=0) < 2**53  # exact as float64, as Python's int / int divides
        sp = np.asarray(sps, dtype=np.int64)[None, :]
        vis = None if vis is None else tuple(v[:, None] for v in vis)
        fields = self._fields(n_tok[:, None], pairs[:, None], lengths[:, None], sp, True, vis)
        shape = (len(n_tok), len(sps))
        return TermsArray(
            self.model.num_layers,
            *(np.broadcast_to(f, shape) for f in fields),
            keep_all_feasible=np.ones(shape, dtype=bool),
        )

    def _floors(self, n_samples):
        """The layer's launch floor and its attention sub-block's part, for a micro-batch of
        ``n_samples`` samples (a float or an array): the calibration's, plus the fixed cost of
        each further attention call where the kernel calls once per document (`attention_calls`)."""
        floor, attn_floor = self.cal.floor_s, self.cal.floor_s * self._share
        if not self._doc_call:
            return floor, attn_floor
        calls = (n_samples - 1) * self._doc_call
        return floor + calls, attn_floor + calls

    def _fields(self, n_tok, pairs, n_samples, sp: int, array: bool, vis=None) -> tuple:
        """`MicroBatchTerms`' fields after `num_layers`, in order, of a micro-batch of `n_tok`
        tokens, `pairs` attention pairs and `n_samples` samples at `sp` (and `vis`, its vision
        patches and pairs, summed, and its largest image's: `cost.vision`): floats, or
        (`array`) arrays of many micro-batches at many degrees (broadcast), by the same
        operations in the same order."""
        m, cal = self.model, self.cal
        smax = _smoothmax_many if array else _smoothmax
        L = m.num_layers
        n = n_tok / sp  # tokens each rank holds; attention work is head-sharded likewise
        pr = pairs / sp
        lin = n * self._lin
        floor, attn_floor = self._floors(n_samples)
        compute = smax(floor, lin + pr * self._attn, cal.p)
        c_attn = smax(attn_floor, lin * self._share + pr * self._attn, cal.p)
        c_mlp = smax(cal.floor_s * (1 - self._share), lin * (1 - self._share), cal.p)
        act_bytes = n * m.hidden * m.bytes_per_value
        if self.cluster.ring:  # each micro-batch at its best (Ulysses, ring) split (`cost.ring`)
            comm, comm_fwd = layer_comm(m, self.cluster, n_tok, pairs, sp, self._attn, array)
        else:  # the bytes of the layer's hidden-sized units, a latency per call the runtime makes:
            # per attention sub-block (a factorized pair's two as well) q, k, v to head sharding
            # and the output back; grouped k, v smaller (repeated if sp needs), MLA values and
            # outputs at their own head size (`cost.heads.layer_a2a_units`)
            a2a_fwd = np.array([[layer_a2a_units(m, int(k)) for k in sp.ravel()]]) if array else layer_a2a_units(m, sp)
            a2a = alltoall_time_many if array else alltoall_time
            t_a2a, t_lat = a2a(self.cluster, sp, act_bytes), a2a(self.cluster, sp, 0.0 * act_bytes)
            comm_fwd = a2a_fwd * (t_a2a - t_lat) + layer_a2a_calls(m) * t_lat
            comm = 2 * comm_fwd
        layer_time = compute + comm
        dt_attn = cal.phi_attn * c_attn + comm_fwd  # recomputed attention repeats its forward communication
        dt_mlp = cal.phi_mlp * c_mlp
        head = n * self._head_s_per_token
        if self._shard is not None:  # the shard block's all-gathers and reduce-scatters
            head += self._shard.exposed_many(compute, L) if array else self._shard.exposed(compute, L)
        tower = 0.0
        if self._vision is not None:  # the tower before the layers: its time and kept activations
            vp, vq = self._vision.rank_work(vis, sp, array)
            head = head + self._vision.time(vp, vq)
            tower = self._vision.kept_bytes(vp, vq)
        # time_none, dt_attn, dt_mlp, dt_full, then the memory fields
        return (L * layer_time + head, dt_attn, dt_mlp, dt_attn + dt_mlp, *self._memory(n, n_samples, tower, array))

    def _memory(self, n, n_samples, tower, array: bool) -> tuple:
        """`MicroBatchTerms`' memory fields (fixed_bytes, act_layer, save_attn, save_mlp,
        save_full, transient_none, transient_rec) of `n` tokens and `n_samples` samples per rank:
        the model states, the output head's kept bytes and a vision tower's (`tower`); per layer
        the calibrated kept activations; and the backward's peak on top of what is kept
        (`cost.backward_memory`): the loss's backward or one layer's, whichever is larger, a
        recomputing layer's recomputed activations included."""
        act_layer = n * (self._act_attn + self._act_mlp + self._act_rest) + n_samples * self._act_sample
        out = output_head_bytes(self.model, n, array)
        fixed = self._state + out.kept + tower
        layer = layer_backward_bytes(self.model, n, array)
        larger = np.maximum if array else max
        return (
            fixed,
            act_layer,
            n * self._act_attn,
            n * self._act_mlp,
            act_layer - n * self._act_full,
            larger(out.backward, layer),
            larger(out.backward, act_layer + layer),
        )
