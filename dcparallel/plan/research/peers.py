"""Other systems' rules as policies, reproduced from their published descriptions (no code
of theirs): they plan the same steps as every other policy, on the same cost model.

- `megatron-dcp` — Megatron-Core's dynamic context parallelism as documented: a sample's
  CP size is the next power of two of (its tokens / the most tokens one rank holds); the
  samples of one CP size are packed into sequences of up to CP size x that many tokens; the
  packed sequences are balanced over the data-parallel groups of each CP size (longest
  first to the least-loaded group), with ranks given to the CP sizes in proportion to their
  work.
- `hbp` — hierarchical balance packing as described: a few fixed packing lengths (here three
  levels: one rank, the middle of the allowed SP degrees, the widest any sample needs), each
  with its own SP degree and checkpointing; a sample goes to the shortest level that holds
  it; each level's samples are packed first-fit decreasing into its length; the packs are
  balanced over that level's groups, ranks given to levels in proportion to their work.

Both take recompute per micro-batch as the fastest whole-model setting that fits ("fit"),
which is at least as fast as the single setting those systems pick per run or level.
"""

from __future__ import annotations

from typing import Sequence

from dcparallel.plan.assemble import assemble, lpt
from dcparallel.plan.binpack import pack_bins
from dcparallel.plan.bucket import best_tuned, even_subset
from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import Step
from dcparallel.plan.types import Chunk, GroupPlan, MicroBatch, Score, StepPlan, Tuned


def _rank_capacity(ctx: PlanContext) -> int:
    """The most tokens one rank holds: the longest sample (text: any length, by bisection;
    video: the largest bucket) that fits one rank with the fastest setting that fits."""
    model = ctx.model
    if model.kind == "text":
        lo, hi = 1, 1
        while hi < 1 << 26 and ctx.copies_layout(hi * 2, 1, 1, "fit") is not None:
            hi *= 2
        lo, hi = hi, hi * 2
        while hi - lo > max(1, lo // 256):
            mid = (lo + hi) // 2
            if ctx.copies_layout(mid, 1, 1, "fit") is not None:
                lo = mid
            else:
                hi = mid
        return lo if ctx.copies_layout(lo, 1, 1, "fit") is not None else 1
    fits = [model.tokens(s) for s in ctx.rep.values() if ctx.copies_layout(s, 1, 1, "fit") is not None]
    return max(fits, default=1)


class _LevelPlanner:
    """Shared machinery: samples -> SP level -> packs of a token capacity -> groups."""

    name = "peer"

    def __init__(self, ctx: PlanContext, cap: int | None = None):
        self.ctx = ctx
        self.cap = _rank_capacity(ctx) if cap is None else cap
        self.chain = list(ctx.sp_sizes)
        self._level: dict = {}

    def describe(self) -> dict:
        return {"rank_capacity_tokens": self.cap, "recompute": "fit", "levels": self.levels()}

    def levels(self) -> list[int]:
        return self.chain

    def level_of(self, i: int) -> int:
        raise NotImplementedError

    def _fits_at(self, i: int, k: int) -> int:
        """The smallest chain degree >= k at which sample i fits (memory)."""
        size = self.ctx.sizes[i]
        key = (size, k)
        hit = self._level.get(key)
        if hit is None:
            hit = next(
                (j for j in self.chain if j >= k and self.ctx.copies_layout(size, 1, j, "fit") is not None),
                self.chain[-1],
            )
            self._level[key] = hit
        return hit

    def _pack(self, ids: list[int], k: int, length: int) -> list[Chunk]:
        ctx = self.ctx
        return [
            Chunk(tuple(b), *ctx.layout_for(tuple(ctx.sizes[j] for j in b), k, "fit"))
            for b in pack_bins(ctx, ids, length, k, "fit")
        ]

    def plan(self, step: Step) -> StepPlan:
        ctx = self.ctx
        world = ctx.cluster.world_size
        by_k: dict[int, list[int]] = {}
        for i in step.sample_ids:
            by_k.setdefault(self.level_of(i), []).append(i)
        while sum(by_k) > world:  # every level needs a group: fold the least-work level upward
            ks = sorted(by_k)
            small = min(ks[:-1], key=lambda k: (sum(ctx.tokens[i] for i in by_k[k]), k))
            up = next(k for k in ks if k > small)
            by_k[up].extend(by_k.pop(small))
        packs = {k: self._pack(ids, k, self.pack_length(k)) for k, ids in by_k.items()}
        count = {k: 1 for k in packs}
        free = world - sum(packs)
        # ranks to levels in proportion to their work: the level with the most work per group next
        while True:
            open_ = [k for k in packs if k <= free and count[k] < len(packs[k])]
            if not open_:
                break
            k = max(open_, key=lambda j: (sum(c.time for c in packs[j]) / count[j], -j))
            count[k] += 1
            free -= k
        sizes, mbs = [], []
        for k in sorted(packs, reverse=True):
            assign, _ = lpt([c.time for c in packs[k]], count[k])
            for g in range(count[k]):
                sizes.append(k)
                mbs.append(tuple(MicroBatch(packs[k][j].sample_ids, packs[k][j].layout) for j in assign[g]))
        return assemble(ctx, step, [GroupPlan(r, m) for r, m in zip(ctx.topology.tile(sizes), mbs)])

    def pack_length(self, k: int) -> int:
        return k * self.cap


class MegatronDynamicCP(_LevelPlanner):
    name = "megatron-dcp"

    def level_of(self, i: int) -> int:
        need = -(-self.ctx.tokens[i] // self.cap)
        p2 = 1 << (need - 1).bit_length()
        return self._fits_at(i, min(p2, self.chain[-1]))


class HierarchicalBalancePacking(_LevelPlanner):
    name = "hbp"

    def __init__(self, ctx: PlanContext, cap: int | None = None):
        super().__init__(ctx, cap)
        widest = max((self._fits_at(b, 1) for b in self._rep_ids()), default=1)
        widest = max(
            widest,
            max(
                (min(self.chain[-1], 1 << (-(-ctx.tokens[i] // self.cap) - 1).bit_length()) for i in self._rep_ids()),
                default=1,
            ),
        )
        widest = next(k for k in self.chain if k >= widest)  # a power of two may fall between chain sizes
        mid = [k for k in self.chain if k <= widest]
        self._levels = sorted({self.chain[0], mid[len(mid) // 2], widest})

    def levels(self) -> list[int]:
        return self._levels

    def _rep_ids(self) -> list[int]:
        """One sample id per bucket: its largest."""
        ctx = self.ctx
        best: dict = {}
        for i in ctx.usable_ids:
            b = ctx.bucket_of[i]
            if b not in best or ctx.tokens[i] > ctx.tokens[best[b]]:
                best[b] = i
        return sorted(best.values())

    def level_of(self, i: int) -> int:
        t = self.ctx.tokens[i]
        need = self._fits_at(i, 1)
        return next((k for k in self._levels if k >= need and t <= k * self.cap), self._levels[-1])


def _tuned(cls, ctx: PlanContext, steps: Sequence[Step], score: Score, max_steps: int = 8) -> Tuned:
    """The rank capacity is those systems' main knob (max tokens per rank): tried at the most
    one rank holds and at 1/2 .. 1/64 of it; the one whose plans of (an even subset of) the
    steps have the least predicted time (`score`) is kept, as the static baselines are tuned."""
    top = _rank_capacity(ctx)
    caps = [max(1, top // d) for d in (1, 2, 4, 8, 16, 32, 64)]
    return best_tuned(((f"cap{cap}", cls(ctx, cap)) for cap in caps), even_subset(steps, max_steps), score)


def build_megatron(ctx: PlanContext, steps: Sequence[Step], score: Score) -> Tuned:
    return _tuned(MegatronDynamicCP, ctx, steps, score)


def build_hbp(ctx: PlanContext, steps: Sequence[Step], score: Score) -> Tuned:
    return _tuned(HierarchicalBalancePacking, ctx, steps, score)
