"""Forward-only passes priced from a training cost model: `ForwardOnlyCost`.

An inference pass over rollouts (old-policy or reference log-probs, values) runs each
micro-batch forward under ``torch.no_grad``: no activation outlives its layer, nothing is
recomputed, no gradient is synced. Its terms come from the training terms of the same
micro-batch, which the cost model already has (measured by the profiler or analytic):

- time: the layers' forward is what full recomputation re-runs, ``L * dt_full``
  (communication included); the rest of the training time (embeddings, head, loss, their
  backward) is counted at a third, forward being about one FLOP in three of forward +
  backward;
- memory: the model states (``fixed_bytes``) plus one layer's activations, the layer
  running (what the training terms count as kept per layer, an upper bound on its forward
  working set); no layer's activations are kept, and the backward's transient never comes.

Recomputation changes nothing here, so every recompute setting prices the same and the
planners choose none; the smaller memory lets them pack bigger micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dcparallel.cost.base import CostModel, MicroBatchTerms
from dcparallel.cost.batch import Batches, TermsArray
from dcparallel.spec import Size


def _forward_time(time_none, dt_full, num_layers):
    layers = num_layers * dt_full
    rest = time_none - 3 * layers
    return layers + np.maximum(rest, 0.0) / 3 if isinstance(rest, np.ndarray) else layers + max(rest, 0.0) / 3


def forward_terms(t: MicroBatchTerms) -> MicroBatchTerms:
    """The forward-only terms of a micro-batch from its training terms (module docstring)."""
    return dataclasses.replace(
        t,
        time_none=float(_forward_time(t.time_none, t.dt_full, t.num_layers)),
        dt_attn=0.0,
        dt_mlp=0.0,
        dt_full=0.0,
        fixed_bytes=t.fixed_bytes + t.act_layer,
        act_layer=0.0,
        save_attn=0.0,
        save_mlp=0.0,
        save_full=0.0,
        transient_none=0.0,
        transient_rec=0.0,
        keep_all_feasible=True,
    )


def forward_terms_array(t: TermsArray) -> TermsArray:
    """`forward_terms` elementwise."""
    zero = np.zeros_like(t.time_none)
    return dataclasses.replace(
        t,
        time_none=_forward_time(t.time_none, t.dt_full, t.num_layers),
        dt_attn=zero,
        dt_mlp=zero,
        dt_full=zero,
        fixed_bytes=t.fixed_bytes + t.act_layer,
        act_layer=zero,
        save_attn=zero,
        save_mlp=zero,
        save_full=zero,
        transient_none=zero,
        transient_rec=zero,
        keep_all_feasible=np.ones_like(t.keep_all_feasible),
    )


class ForwardOnlyCost:
    """The cost model of forward-only passes over a training cost model ``base`` (the same
    model, cluster and SP degrees); no gradient sync."""

    def __init__(self, base: CostModel):
        self.base = base
        self.model, self.cluster, self.sp_sizes = base.model, base.cluster, base.sp_sizes
        if hasattr(base, "best_split"):  # the (Ulysses, ring) split its terms are priced at (`cost.ring`)
            self.best_split = base.best_split

    def terms(self, sizes: Sequence[Size], sp: int) -> MicroBatchTerms:
        return forward_terms(self.base.terms(sizes, sp))

    def terms_copies(self, size: Size, count: int, sp: int) -> MicroBatchTerms:
        return forward_terms(self.base.terms_copies(size, count, sp))

    def terms_copies_grid(self, sizes: Sequence[Size], counts: np.ndarray, sp: int) -> TermsArray:
        return forward_terms_array(self.base.terms_copies_grid(sizes, counts, sp))

    def terms_grid(self, batches: Batches, sps: Sequence[int]) -> TermsArray:
        return forward_terms_array(self.base.terms_grid(batches, sps))

    def grad_sync_time(self) -> float:
        return 0.0

    def model_state_bytes(self) -> float:
        return self.base.model_state_bytes()
