"""The per-sample packing's groups (`sample.SamplePacker`): a group while packing (`Node`) and
packed (`Group`), and a step's packing (`Packing`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Group(NamedTuple):
    """One packed group: its SP degree, predicted finish, its micro-batches' sample ids in run
    order, and its sub-groups (the equal slices of its block that run before it, in block order)."""

    sp: int
    finish: float
    items: list[tuple[int, ...]]
    subgroups: list[Group]


class Packing(NamedTuple):
    """A step's packed groups (widest first) and its predicted time, exposed sync included."""

    groups: list[Group]
    span: float


@dataclass(slots=True)
class Node:
    """A group while packing. `base` is None for a top-level group (its finish adds the sync its
    longest member leaves exposed), else the parent's finish when it split: the sub-group runs
    on a slice of the parent's ranks before the parent's own micro-batches, which wait for it."""

    deg: int  #: its degree, as an index into the packer's degrees
    load: float  #: its members' summed time
    rows: list[int]  #: its members (micro-batch rows), in the order placed
    longest: float  #: its longest member's time
    base: float | None
    kids: list[int]  #: its sub-groups (indices among the packing's nodes)

    def copy(self) -> Node:
        return Node(self.deg, self.load, list(self.rows), self.longest, self.base, list(self.kids))
