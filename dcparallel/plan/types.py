"""Plan objects: what one optimizer step runs, on which ranks, in which order."""

from __future__ import annotations

from dataclasses import dataclass

from dcparallel.spec import Layout


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Samples run together in one forward/backward by one group, with their layout."""

    sample_ids: tuple[int, ...]
    layout: Layout

    def to_json(self) -> dict:
        return {"sample_ids": list(self.sample_ids), "layout": self.layout.to_json()}


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """An aligned block of ranks that runs its micro-batches in order during one step."""

    ranks: tuple[int, ...]
    micro_batches: tuple[MicroBatch, ...]

    @property
    def sp(self) -> int:
        return len(self.ranks)

    def to_json(self) -> dict:
        return {"ranks": list(self.ranks), "micro_batches": [m.to_json() for m in self.micro_batches]}


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One optimizer step: its samples, the groups tiling the world, and its token count.

    The exact loss normalizer (targets that are not ignored) is counted at run time."""

    index: int
    sample_ids: tuple[int, ...]
    groups: tuple[GroupPlan, ...]
    num_tokens: int

    def group_of(self, rank: int) -> GroupPlan:
        for g in self.groups:
            if rank in g.ranks:
                return g
        raise ValueError(f"rank {rank} is in no group of step {self.index}")

    def micro_batches(self):
        for g in self.groups:
            yield from g.micro_batches

    def to_json(self) -> dict:
        return {"step": self.index, "num_tokens": self.num_tokens,
                "sample_ids": list(self.sample_ids), "groups": [g.to_json() for g in self.groups]}

    def validate(self, world_size: int, allowed: set[tuple[int, ...]] | None = None) -> None:
        """Internal invariants: groups tile the world, each micro-batch runs at its group's
        SP degree with as many samples as its layout says, every step sample is used once."""
        seen_ranks: list[int] = []
        for g in self.groups:
            assert allowed is None or g.ranks in allowed, f"group {g.ranks} is not an allowed group"
            seen_ranks.extend(g.ranks)
            for m in g.micro_batches:
                assert m.layout.sp == g.sp, f"micro-batch sp {m.layout.sp} on a group of {g.sp}"
                assert m.layout.mbs == len(m.sample_ids), "layout mbs differs from its samples"
        assert sorted(seen_ranks) == list(range(world_size)), f"groups do not tile the world: {seen_ranks}"
        used = sorted(i for m in self.micro_batches() for i in m.sample_ids)
        assert used == sorted(self.sample_ids), f"step {self.index} does not use each sample once"
