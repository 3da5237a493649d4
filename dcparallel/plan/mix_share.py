"""The fewest GPU-seconds one sample adds to any micro-batch that fits, whatever it is mixed with
(docs/design.md, "Mixed micro-batches"): the A2 of `plan/bounds.py` for models whose
micro-batches mix sizes (text: `dcp` packs one bucket's documents into a row, `packed` any).

A micro-batch B at degree k with recompute r takes time(B, r), and r fits B in memory, so it
fits each of B's samples alone (memory grows with every sample added). Copies of a long
document fit one or two at a time, while a micro-batch of it with short ones shares its launch
floor and exchange latency with their work: the copies' fewest GPU-seconds are no bound there.
Each sample s is priced instead at

    g_k(s) = k * min over (M, r) of time(M copies of s, r) / M,

r fitting s alone (at least), the least over the recomputes by PAC's knapsack on terms whose
times are those of M copies per copy and whose memory is one copy's or more (`cheapest`).
Which M and which memory make sum_s g_k(s) <= k * time(B, r) for every B depends on how the
cost model prices a mix:

- the analytic model (`priced_by_sums`): from B's token and pair sums, through terms each
  either a function above its asymptote whose value per unit of work falls as the work grows
  (the launch floor's smooth maximum, exchanges affine with a latency) or non-negative and
  falling with the work (exposed shard collectives). With copies whose tokens and pairs both
  reach B's, each term per copy is at most the sample's part of the same term of B; and B's
  recompute fits one sample of B's tokens. So on each interval of B's tokens a sample is
  priced at its copies sized by the interval's top, at the recompute its bottom allows
  (`sum_shares`): large micro-batches share their fixed costs but recompute more.
- a profile: each sample at the per-sample time of as many copies as B holds, piecewise
  linear in the count between measured sizes (all at most `context.MAX_MBS`) and linear
  beyond: the least over every count to `MAX_MBS`, the powers of two to `BOUND_MAX_COPIES` and
  the asymptote (the per-copy difference between `ASYMPTOTE` and twice as many copies).
- ring clusters: a ring send is exposed only beyond the attention it overlaps, so a long
  sample's attention hides short ones' sends: the asymptote with every send hidden
  (`ring_hidden`), with the counts above.

Video micro-batches stack samples of one latent shape (`spec.batch_key`), costed as copies:
their A2 needs no mix and keeps the memory of the copies (`PlanContext.fewest_gpu_seconds`).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Sequence

import numpy as np

from dcparallel.cost.analytic import AnalyticCost
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
#: the ratio between the token counts `sum_shares` prices a text sample's share at
SHARE_GRID = 2 ** (1 / 8)
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
    if priced_by_sums(ctx):
        return sum_shares(ctx, sizes, k)
    counts = share_counts()
    c = len(counts)
    grid = ctx.cost.terms_copies_grid([s for s in sizes for _ in range(c)], np.tile(counts, len(sizes)), k)
    hidden = ring_hidden(ctx, sizes, k) if ctx.cluster.ring else None
    per = {}
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
    return cheapest(ctx, sizes, k, per)


def cheapest(ctx: PlanContext, sizes: Sequence[Size], k: int, per: dict[str, np.ndarray], memory=None) -> np.ndarray:
    """k times the least over the columns of `per` (per row, the time fields per copy of some
    copy counts) and over the recomputes that fit `memory` (terms of one row each; default one
    copy of each size): PAC's knapsack on terms of those times and that memory."""
    if memory is None:
        memory = ctx.cost.terms_copies_grid(list(sizes), np.ones(len(sizes), dtype=np.int64), k)
    shape = per["time_none"].shape
    hybrid = TermsArray(
        memory.num_layers,
        **{
            f.name: per[f.name] if f.name in per else np.broadcast_to(getattr(memory, f.name)[:, :1], shape)
            for f in fields(TermsArray)
            if f.name != "num_layers"
        },
    )
    attn, mlp = hybrid.cheapest_recompute(ctx.budget)
    ok = attn >= 0
    t = np.where(ok, hybrid.time(np.where(ok, attn, 0), np.where(ok, mlp, 0)), np.inf)
    return t.min(axis=1) * k


def priced_by_sums(ctx: PlanContext) -> bool:
    """Whether a micro-batch's time is the analytic model's function of its token and pair sums
    (`sum_copies`): text without a vision tower, no ring (whose exposed sends are not), priced by
    `AnalyticCost` or a wrapper of it (`inner` / `base`: an affine correction, forward only)."""
    if ctx.model.kind != "text" or ctx.model.vision is not None or ctx.cluster.ring:
        return False
    cost = ctx.cost
    for _ in range(8):
        if isinstance(cost, AnalyticCost):
            return True
        cost = vars(cost).get("inner", vars(cost).get("base"))
        if cost is None:
            return False
    return False


def sum_shares(ctx: PlanContext, sizes: Sequence[Size], k: int) -> np.ndarray:
    """g_k of each size on a cost priced by sums (`priced_by_sums`). A micro-batch B of N_B
    tokens holds at most pairs(N_B) pairs (pairs are superadditive: a sequence attends to at
    least its pieces' pairs), and its recompute fits one sample of N_B tokens (whose memory is
    the least of N_B tokens'). So on the N_B in [lo, hi] a sample s adds at least its per-copy
    time among M copies, M * tokens(s) >= hi and M * pairs(s) >= pairs(hi), at the fastest
    recompute that fits one sample of lo tokens: the least of that over the intervals
    [lo, hi] of a geometric grid (`SHARE_GRID`) from tokens(s) to the most tokens that fit."""
    model = ctx.model
    top = most_tokens(ctx, k)
    tok = np.array([model.tokens(s) for s in sizes], dtype=np.int64)
    if top == 0:
        return np.full(len(sizes), np.inf)
    cuts = np.unique(np.round(SHARE_GRID ** np.arange(int(np.log(top) / np.log(SHARE_GRID)) + 2)).astype(np.int64))
    owner, lo, hi = [], [], []
    for i, t in enumerate(tok.tolist()):  # [t, top] cut at the grid (one [t, t] if t does not fit)
        ends = [t, *cuts[(cuts > t) & (cuts < top)].tolist(), max(top, t)]
        owner += [i] * (len(ends) - 1)
        lo += ends[:-1]
        hi += ends[1:]
    owner_a, hi_a = np.array(owner), np.array(hi, dtype=np.int64)
    pairs_of = {n: float(model.attention_pairs(n)) for n in set(hi) | set(tok.tolist())}
    own_pairs = np.array([pairs_of[int(t)] for t in tok[owner_a]])
    hi_pairs = np.array([pairs_of[int(h)] for h in hi])
    m = np.ceil(np.maximum(hi_a / tok[owner_a], hi_pairs / np.maximum(own_pairs, 1.0)))
    m = np.clip(m, 1, 2**52 // np.maximum(hi_a, 1)).astype(np.int64)
    grid = ctx.cost.terms_copies_grid([sizes[i] for i in owner], m, k)
    per = {name: getattr(grid, name)[:, :1] / m[:, None] for name in TIME_FIELDS}
    memory = ctx.cost.terms_copies_grid(lo, np.ones(len(lo), dtype=np.int64), k)
    rows = cheapest(ctx, [sizes[i] for i in owner], k, per, memory)
    out = np.full(len(sizes), np.inf)
    np.minimum.at(out, owner_a, rows)
    return out


def most_tokens(ctx: PlanContext, k: int) -> int:
    """The most tokens one text sample may have and fit k ranks at some recompute (0: none)."""

    def fits(t: int) -> bool:
        return ctx.cost.terms_copies(t, 1, k).cheapest_recompute(ctx.budget) is not None

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


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
