"""First-fit-decreasing bin packing of a step's samples (`pack_bins`), in O(n log n).

First fit puts each sample, longest first, into the leftmost bin with room for it. Scanning
the bins for each sample is quadratic (a step of 4096 samples in 1000 bins scans millions of
bins); here the bins' rooms sit in a max-tree (`RoomTree`), and the leftmost bin with room
``t`` is found by descending from the root, always left where the left half has room. A run
of samples of one length (every sample of a video shape) goes into a bin as many at a time
as the bin holds: first fit would put them there one by one, since every bin left of it has
less room than one of them. The bins and their order are first fit's exactly.

Each bin is then checked against memory (`PlanContext.layout_for`, whose terms the planner's
pricing of the bins reuses), and a bin that does not fit is cut where it stops fitting.
"""

from __future__ import annotations

from itertools import groupby
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from dcparallel.plan.context import PlanContext, RecomputeMode


class RoomTree:
    """Bins' free room, in bin order, in a max-tree over a power-of-two number of leaves,
    doubled as bins open (a step of few bins keeps a shallow tree): `leftmost(t)` is the first
    bin with room >= t in O(log bins)."""

    def __init__(self):
        self.size = 16
        self.room = [float("-inf")] * (2 * self.size)  # an unopened bin has no room
        self.num_bins = 0

    def open(self, room: float) -> int:
        """A new bin (the last), with ``room``; its index."""
        b = self.num_bins
        if b == self.size:  # full: twice the leaves, the inner nodes rebuilt
            leaves = self.room[self.size :] + [float("-inf")] * self.size
            self.size *= 2
            self.room = [float("-inf")] * self.size + leaves
            for node in range(self.size - 1, 0, -1):
                self.room[node] = max(self.room[2 * node], self.room[2 * node + 1])
        self.num_bins += 1
        self.set(b, room)
        return b

    def set(self, b: int, room: float) -> None:
        node, tree = b + self.size, self.room
        tree[node] = room
        node >>= 1
        while node:  # (written out, no `max` call: first fit's innermost loop)
            left, right = tree[2 * node], tree[2 * node + 1]
            best = left if left >= right else right
            if tree[node] == best:
                break  # the ancestors hold the same maxima
            tree[node] = best
            node >>= 1

    def leftmost(self, t: float) -> int | None:
        """The first bin whose room is at least ``t``; None if no bin has that room."""
        tree, size = self.room, self.size
        if tree[1] < t:
            return None
        node = 1
        while node < size:
            node <<= 1
            if tree[node] < t:
                node += 1
        return node - size


def first_fit_decreasing(ids: Sequence[int], tokens: Sequence[int], capacity: int) -> list[list[int]]:
    """``ids`` packed first fit, longest first (ties by id), into bins of ``capacity``
    tokens (``tokens[i]``: sample i's); the bins in the order they were opened."""
    order = sorted(ids, key=lambda j: (-tokens[j], j))
    tree = RoomTree()
    bins: list[list[int]] = []
    room: list[int] = []
    pos = 0
    for t, run in groupby(order, key=tokens.__getitem__):
        n = len(list(run))
        end = pos + n
        while pos < end:
            b = tree.leftmost(t)
            if b is None:
                b = tree.open(capacity)
                bins.append([])
                room.append(capacity)
                take = 1  # a new bin takes the sample even where it exceeds the capacity
            else:
                take = end - pos if t <= 0 else min(end - pos, room[b] // t)
            bins[b].extend(order[pos : pos + take])
            room[b] -= take * t
            tree.set(b, room[b])
            pos += take
    return bins


def pack_bins(ctx: PlanContext, ids: Sequence[int], capacity: int, sp: int, mode: RecomputeMode) -> list[list[int]]:
    """Samples packed first-fit decreasing into bins of ``capacity`` tokens, each bin then split
    where it would not fit memory at (``sp``, ``mode``). Video bins are filled within one batch
    key (`spec.batch_key`: same-shape samples stack; shapes never mix in a micro-batch)."""
    if ctx.model.kind == "text":
        classes = [list(ids)]
    else:
        by_key: dict[tuple[int, ...], list[int]] = {}
        for i in ids:
            by_key.setdefault(ctx.bucket_of[i], []).append(i)
        classes = [by_key[k] for k in sorted(by_key)]
    out: list[list[int]] = []
    for b in (b for members in classes for b in first_fit_decreasing(members, ctx.tokens, capacity)):
        if ctx.layout_for(tuple(ctx.sizes[j] for j in b), sp, mode) is not None:
            out.append(b)
            continue
        cur: list[int] = []
        for i in b:
            if cur and ctx.layout_for(tuple(ctx.sizes[j] for j in cur + [i]), sp, mode) is None:
                out.append(cur)
                cur = []
            cur.append(i)
        out.append(cur)
    return out
