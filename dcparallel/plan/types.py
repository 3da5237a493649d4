"""Plan objects: what one optimizer step runs, on which ranks, in which order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence

from dcparallel.spec import Layout

#: a candidate replaces the best so far only if better by this relative margin, so ties keep
#: the first candidate of the fixed search order (every rank computes the same plan)
REL_TOL = 1e-9
#: a micro-batch moves off the slowest group only if that shortens it by this fraction
MIN_GAIN = 1e-6
#: float times (seconds) closer than this are equal
TIME_EPS = 1e-12
#: slack against float rounding before a ceiling (``ceil(work / T - ROUND_EPS)`` groups)
ROUND_EPS = 1e-9
#: a group within this fraction of the mean load of its degree counts as balanced
BALANCED = 1.001


class NoLayoutFits(ValueError):
    """A sample, a bucket or a whole-run setting fits no layout on the cluster."""


class Fit(NamedTuple):
    """A layout that fits a micro-batch, with the micro-batch's time (seconds)."""

    layout: Layout
    time: float


class Chunk(NamedTuple):
    """A planned micro-batch before it is placed: its samples, layout and time."""

    sample_ids: tuple[int, ...]
    layout: Layout
    time: float


def splits_shard_block(ranks: Sequence[int], shard_size: int) -> bool:
    """Whether an SP group of ``ranks`` splits a parameter-shard block of ``shard_size`` ranks
    (blocks: ranks b*s .. b*s+s-1): it must hold at least s ranks, a multiple of s, starting
    at a multiple of s (s = 1: never)."""
    k, s = len(ranks), shard_size
    return s > 1 and (k < s or k % s != 0 or ranks[0] % s != 0)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Samples run together in one forward/backward by one group, with their layout."""

    sample_ids: tuple[int, ...]
    layout: Layout

    def to_json(self) -> dict:
        return {"sample_ids": list(self.sample_ids), "layout": self.layout.to_json()}


_new_mb = MicroBatch.__new__
_set_ids = MicroBatch.sample_ids.__set__  # type: ignore[attr-defined]
_set_layout = MicroBatch.layout.__set__  # type: ignore[attr-defined]


def micro_batches(pairs: Iterable[tuple[tuple[int, ...], Layout]]) -> list[MicroBatch]:
    """`MicroBatch(ids, layout)` for each pair: the same objects, built without the frozen
    dataclass's checked assignments (a planner at thousands of GPUs builds tens of thousands
    per step)."""
    out = []
    for ids, layout in pairs:
        m = _new_mb(MicroBatch)
        _set_ids(m, ids)
        _set_layout(m, layout)
        out.append(m)
    return out


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """An aligned block of ranks that runs its micro-batches in order during one phase of a
    step (see `StepPlan`)."""

    ranks: tuple[int, ...]
    micro_batches: tuple[MicroBatch, ...]
    phase: int = 0

    @property
    def sp(self) -> int:
        return len(self.ranks)

    def to_json(self) -> dict:
        return {
            "ranks": list(self.ranks),
            "phase": self.phase,
            "micro_batches": [m.to_json() for m in self.micro_batches],
        }


class GroupSource(Protocol):
    """A step's groups held compactly (arrays) by the planner that made them: `StepPlan`
    builds the `GroupPlan` objects from it on demand (all of them for `groups`; one rank's
    for `groups_of`), so that no rank builds the objects of every other rank's work."""

    def build(self) -> tuple[GroupPlan, ...]: ...

    def of_rank(self, rank: int) -> tuple[GroupPlan, ...]: ...

    def busy_sizes(self) -> set[int]: ...

    def holds_once(self, sample_ids: tuple[int, ...]) -> bool:
        """Whether the micro-batches hold each of `sample_ids` exactly once (on the arrays,
        without building the groups)."""
        ...


class StepPlan:
    """One optimizer step: its samples, its groups, and its token count.

    A step runs in one or more *phases*; the groups of each phase tile the world, and every
    rank runs its phase-0 group's micro-batches, then its phase-1 group's, and so on (a
    group's collectives start once all its ranks reach it). One phase is the common case;
    more let a step run a long sample on a wide group and its short samples on narrow ones,
    on the same ranks (narrow after wide, or narrow sub-groups of a wide group's block before
    it). `groups` are listed in phase order. The exact loss normalizer
    (targets that are not ignored) is counted at run time.

    `groups` may be given as a `GroupSource`: the objects are then built when first read,
    and `groups_of(rank)` (what a training rank reads) builds only that rank's. A plan is
    immutable; two plans are equal when their fields are."""

    __slots__ = ("index", "sample_ids", "num_tokens", "_groups", "_source")

    def __init__(
        self, index: int, sample_ids: tuple[int, ...], groups: tuple[GroupPlan, ...] | GroupSource, num_tokens: int
    ):
        source = groups if hasattr(groups, "of_rank") else None
        for name, value in (
            ("index", index),
            ("sample_ids", sample_ids),
            ("num_tokens", num_tokens),
            ("_groups", tuple(groups) if source is None else None),
            ("_source", source),
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a StepPlan is immutable (tried to set {name!r})")

    @property
    def groups(self) -> tuple[GroupPlan, ...]:
        if self._groups is None:
            object.__setattr__(self, "_groups", self._source.build())
        return self._groups

    def _key(self) -> tuple:
        return self.index, self.sample_ids, self.groups, self.num_tokens

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepPlan) and self._key() == (
            other.index,
            other.sample_ids,
            other.groups,
            other.num_tokens,
        )

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"StepPlan(index={self.index!r}, sample_ids={self.sample_ids!r}, groups={self.groups!r}, "
            f"num_tokens={self.num_tokens!r})"
        )

    def __reduce__(self):
        return StepPlan, (self.index, self.sample_ids, self._source or self._groups, self.num_tokens)

    @property
    def num_phases(self) -> int:
        return 1 + max((g.phase for g in self.groups), default=0)

    def groups_of(self, rank: int) -> tuple[GroupPlan, ...]:
        """The rank's group in each phase, in phase order."""
        if self._groups is None:
            out = self._source.of_rank(rank)
        else:
            out = tuple(g for g in self._groups if rank in g.ranks)
        if not out:
            raise ValueError(f"rank {rank} is in no group of step {self.index}")
        return out

    def busy_sizes(self) -> list[int]:
        """The SP degrees of the groups that run micro-batches, ascending."""
        if self._groups is None:
            return sorted(self._source.busy_sizes())
        return sorted({g.sp for g in self._groups if g.micro_batches})

    def work_of(self, rank: int) -> tuple[tuple[MicroBatch, tuple[int, ...]], ...]:
        """The micro-batches the rank runs, in order, each with its group's ranks."""
        return tuple((m, g.ranks) for g in self.groups_of(rank) for m in g.micro_batches)

    def micro_batches(self):
        for g in self.groups:
            yield from g.micro_batches

    def check_samples(self) -> None:
        """Refuses (ValueError) a plan whose micro-batches do not hold each of the step's
        samples exactly once, naming the samples left out and those planned twice: a planner
        that lost or repeated a sample would otherwise train on less, or more, than the step."""
        if self._source is not None and self._source.holds_once(self.sample_ids):
            return  # checked on the arrays; the objects are built only to name what is wrong
        used = [i for m in self.micro_batches() for i in m.sample_ids]
        if len(used) == len(self.sample_ids) and sorted(used) == sorted(self.sample_ids):
            return
        seen: dict[int, int] = {}
        for i in used:
            seen[i] = seen.get(i, 0) + 1
        step = set(self.sample_ids)
        missing = sorted(step - seen.keys())
        twice = sorted(i for i, n in seen.items() if n > 1)
        extra = sorted(seen.keys() - step)
        raise ValueError(
            f"step {self.index}: the plan does not hold each of its {len(step)} samples once: "
            f"{len(missing)} left out {missing[:8]}, {len(twice)} planned more than once {twice[:8]}, "
            f"{len(extra)} not in the step {extra[:8]}; this is a planner bug (the plan is refused, not trained)"
        )

    def to_json(self) -> dict:
        return {
            "step": self.index,
            "num_tokens": self.num_tokens,
            "sample_ids": list(self.sample_ids),
            "groups": [g.to_json() for g in self.groups],
        }

    def validate(self, world_size: int, allowed: set[tuple[int, ...]] | None = None) -> None:
        """Internal invariants: groups are listed in phase order and each phase's groups tile
        the world, each micro-batch runs at its group's SP degree with as many samples as its
        layout says, every step sample is used once."""
        phases = [g.phase for g in self.groups]
        assert phases == sorted(phases), f"groups are not in phase order: {phases}"
        assert sorted(set(phases)) == list(range(self.num_phases)), f"phases are not 0..n-1: {phases}"
        for p in range(self.num_phases):
            seen_ranks: list[int] = []
            for g in self.groups:
                if g.phase != p:
                    continue
                assert allowed is None or g.ranks in allowed, f"group {g.ranks} is not an allowed group"
                seen_ranks.extend(g.ranks)
                for m in g.micro_batches:
                    assert m.layout.sp == g.sp, f"micro-batch sp {m.layout.sp} on a group of {g.sp}"
                    assert m.layout.mbs == len(m.sample_ids), "layout mbs differs from its samples"
            assert sorted(seen_ranks) == list(range(world_size)), (
                f"phase {p}'s groups do not tile the world: {seen_ranks}"
            )
        self.check_samples()

    def check_shard_blocks(self, shard_size: int) -> None:
        """Refuses (ValueError) a plan in which a parameter-shard block of ``shard_size`` ranks
        would run two different micro-batch sequences: every group that runs micro-batches must
        hold whole aligned blocks (`splits_shard_block`); idle groups, which run nothing, may be
        single ranks. Otherwise FSDP's per-layer collectives inside the block would not match
        and the step would hang."""
        s = shard_size
        for g in self.groups:
            if g.micro_batches and splits_shard_block(g.ranks, s):
                raise ValueError(
                    f"step {self.index}: the group of ranks {tuple(g.ranks)} runs micro-batches but splits "
                    f"a parameter-shard block of {s} ranks (blocks are ranks b*{s} .. b*{s}+{s - 1}): its ranks "
                    f"would run different micro-batches and FSDP would hang; plan with a ClusterSpec whose "
                    f"shard_size is {s} (SP groups of whole blocks, aligned)"
                )


#: the predicted seconds of one step's plan (compute + the exposed gradient sync), passed in to
#: the policies that tune or compare plans (the simulator's: `sim.replay.step_seconds(ctx)`)
Score = Callable[[StepPlan], float]


class PricedScore(Protocol):
    """A `Score` that can also score a plan whose micro-batches' times its planner already
    holds (the simulator's, `sim.replay.StepSeconds`): `priced(plan, times)` equals
    `score(plan)` where `times` are each micro-batch's time at its layout on `ctx`
    (`PlanContext.mb_costs`' times, in the plan's order: the groups', then each group's)."""

    ctx: Any

    def __call__(self, plan: StepPlan) -> float: ...

    def priced(self, plan: StepPlan, times: Sequence[float]) -> float: ...


@dataclass(frozen=True)
class Tuned:
    """A built planner (`plan.policies.Planner`) and, for a policy tuned on the data, the
    predicted seconds of every setting it tried on the sampled steps (name -> seconds)."""

    planner: Any
    tried: dict[str, float] = field(default_factory=dict)
