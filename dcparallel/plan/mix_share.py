"""The fewest GPU-seconds one sample adds to any micro-batch that fits, whatever it is mixed with
(docs/design.md, "Lower bound and efficiency"): the A2 of `plan/bounds.py` for models whose
micro-batches mix sizes (text: `dcp` packs one bucket's documents into a row, `packed` any).

A micro-batch B at degree k with recompute r takes time(B, r), and r fits B in memory, so it
fits each of B's samples alone (memory grows with every sample added). The cost models price
B from sums over its samples (tokens, attention pairs, vision patches) through functions that
lie above their asymptotes: the analytic model's launch floor is a smooth maximum above the
linear work, its exchanges an affine function of the bytes, its exposed shard collectives at
least zero; a profile prices each sample at the per-sample time of as many copies as B holds.
So each sample s adds at least

    share_k(s) = min over r fitting s alone, over n >= 1, of time(n copies of s, r) / n

(time(n copies, r) / n falls to its asymptote as n grows on the analytic model; on a profile
it is piecewise linear in n between the measured micro-batch sizes, all of at most
`context.MAX_MBS`, and linear beyond), and sum_s share_k(s) <= time(B, r): the planners' one
micro-batch of a 27,825-token document with two short ones amortizes the long one's launch
floor over the short ones' work, which copies of the long one, fitting only one at a time,
cannot. g_k(s) = k * share_k(s). The n tried: every n up to `MAX_MBS`, the powers of two to
`BOUND_MAX_COPIES`, and the asymptote, taken as the per-copy difference between `ASYMPTOTE`
and twice as many copies (below the asymptote where the function is convex, exact where affine).
The min over r is PAC's knapsack on terms whose times are those of n copies per copy and whose
memory is one copy's.

Video micro-batches stack samples of one latent shape (`spec.batch_key`), costed as copies:
their A2 needs no mix and keeps the memory of the copies (`PlanContext.fewest_gpu_seconds`).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Sequence

import numpy as np

from dcparallel.cost.batch import Batches, TermsArray
from dcparallel.cost.vision import sample_vision
from dcparallel.plan.context import MAX_MBS, PlanContext
from dcparallel.spec import Size

#: the most copies of one size a micro-batch of the step may be priced at, besides the asymptote
BOUND_MAX_COPIES = 1 << 16
#: copies at which the per-copy time is taken as its asymptote (with twice as many)
ASYMPTOTE = 1 << 20
#: attention pairs per token of the copies, per rank of the group, that hide every ring send
#: (`ring_hidden`): a thousand times the ratio of a token's K/V bytes over a link to a pair's
#: attention time on the models and links priced (about 1e4 per ring step)
HIDING_PAIRS = 1e6
#: the time fields of `MicroBatchTerms` (the rest are memory)
TIME_FIELDS = ("time_none", "dt_attn", "dt_mlp", "dt_full")


def share_counts() -> np.ndarray:
    """The copy counts priced per size: 1..MAX_MBS, the powers of two above to
    BOUND_MAX_COPIES, then ASYMPTOTE and twice it (their difference)."""
    powers = [1 << i for i in range(MAX_MBS.bit_length(), BOUND_MAX_COPIES.bit_length())]
    return np.array([*range(1, MAX_MBS + 1), *powers, ASYMPTOTE, 2 * ASYMPTOTE], dtype=np.int64)


def fewest_shares(ctx: PlanContext, sizes: Sequence[Size], k: int) -> np.ndarray:
    """share_k(s) * k of each size at degree k (the module docstring), inf where one sample
    does not fit k ranks."""
    counts = share_counts()
    c = len(counts)
    grid = ctx.cost.terms_copies_grid([s for s in sizes for _ in range(c)], np.tile(counts, len(sizes)), k)
    one = ctx.cost.terms_copies_grid(list(sizes), np.ones(len(sizes), dtype=np.int64), k)
    hidden = ring_hidden(ctx, sizes, k) if ctx.cluster.ring else None
    per: dict[str, np.ndarray] = {}
    for name in TIME_FIELDS:
        v = getattr(grid, name)[:, 0].reshape(len(sizes), c)
        # the per-copy time of n copies, then (last columns) the marginal copy's at the asymptote
        rates = [(v[:, -1] - v[:, -2]) / ASYMPTOTE]
        if hidden is not None:
            h = getattr(hidden, name)[:, 0].reshape(len(sizes), 2)
            # less a margin for the rounding of a difference of two times of the attention's size
            rates.append((h[:, 1] - h[:, 0]) / ASYMPTOTE * (1 - 1e-9))
        rate = np.maximum(np.stack(rates, axis=1), 0.0)
        per[name] = np.concatenate([v[:, :-2] / counts[None, :-2], rate], axis=1)
    shape = per["time_none"].shape
    hybrid = TermsArray(
        grid.num_layers,
        **{
            f.name: per[f.name] if f.name in per else np.broadcast_to(getattr(one, f.name)[:, :1], shape)
            for f in fields(TermsArray)
            if f.name != "num_layers"
        },
    )
    attn, mlp = hybrid.cheapest_recompute(ctx.budget)
    ok = attn >= 0
    t = np.where(ok, hybrid.time(np.where(ok, attn, 0), np.where(ok, mlp, 0)), np.inf)
    return t.min(axis=1) * k


def ring_hidden(ctx: PlanContext, sizes: Sequence[Size], k: int) -> TermsArray:
    """Terms of `ASYMPTOTE` and twice as many copies of each size in a micro-batch whose other
    samples bring `HIDING_PAIRS` attention pairs per token of the copies and no token: their
    difference is the asymptote with every ring send hidden under attention. A ring step's send
    is exposed only beyond the attention it overlaps (`cost.ring`), so a mix hides a short
    sample's sends under a long one's attention, which copies of the short one cannot."""
    model = ctx.model
    tokens, pairs, vision = [], [], []
    for s in sizes:
        t, p = model.tokens(s), float(model.attention_pairs(s))
        for m in (ASYMPTOTE, 2 * ASYMPTOTE):
            tokens += [m * t, 0]
            pairs += [m * p, 2.0 * ASYMPTOTE * t * HIDING_PAIRS * k]
            if model.vision is not None:
                v = np.asarray(sample_vision(model.vision, s), dtype=np.int64)
                vision += [v * np.array([m, m, 1, 1]), np.zeros(4, np.int64)]
    batches = Batches(
        np.asarray(tokens, dtype=np.int64),
        np.asarray(pairs, dtype=float),
        np.full(2 * len(sizes), 2, dtype=np.int64),
        np.asarray(vision, dtype=np.int64).reshape(-1, 4) if model.vision is not None else None,
    )
    return ctx.cost.terms_grid(batches, [k])
