"""`Topology`: the one owner of the group geometry — allowed SP sizes, their chain, tilings, data-parallel blocks.

Every consumer of group shapes takes a `Topology`: the planners (through
`PlanContext.topology`), the simulator, the profiler and the runtime's
`ProcessGroups`. A group is an *aligned block*: ``k`` consecutive ranks starting at a
multiple of ``k``. The rules, for a world of whole nodes of ``gpus_per_node`` GPUs and a
model of ``num_heads`` attention heads (Ulysses splits heads, so ``k`` divides them, unless
the topology allows ``ring`` attention: then a group of k = u x r ranks runs Ulysses degree
u dividing the heads inside ring degree r, `splits`):

- **allowed sizes** (`sizes`): ``k`` divides the GPUs per node (a group inside one node) or
  is a multiple of a node (whole nodes), divides the heads, and is a multiple of the
  parameter-shard block size ``shard_size`` (`ClusterSpec.shard_size`): groups of such sizes
  are aligned, so each shard block lies inside one group and its ranks run the same
  micro-batches (their per-layer all-gathers and reduce-scatters match);
- **the chain** (`chain`): the longest run of allowed sizes in which each divides the next.
  Groups of chain sizes placed largest first at consecutive offsets are always aligned,
  so any mix of them tiles the world (`tile`);
- **the mix** (`mix`): the sizes `dcp` may mix within one step — every allowed size inside a
  node, and the chain's sizes beyond one node. Where the sizes inside a node are not one
  chain (SP 3 or 6 beside 2 and 4 on 6- or 12-GPU nodes with heads that allow them), groups
  of mixed sizes are packed node by node (`fits`, `tile`): whole-node groups first, then the
  rest largest first, each at the first aligned offset free in the first node with one;
  ranks a packing leaves free are idle groups of one rank;
- **static sizes** (`static_sizes`): chain sizes whose blocks tile the world alone (the
  static baselines' data-parallel blocks, `data_parallel`).

Pure python: no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dcparallel.spec import ClusterSpec


def group_sizes(cluster: ClusterSpec, num_heads: int, ring: bool = False) -> list[int]:
    """Every allowed SP degree: k divides the GPUs per node or is a multiple of a node,
    divides the attention heads (any k with ``ring``: `ring_splits`), is a multiple of the
    shard size, and at least one aligned block of k ranks fits the world."""
    g, s = cluster.gpus_per_node, cluster.shard_size
    return [
        k
        for k in range(s, cluster.world_size + 1)
        if (g % k == 0 or k % g == 0) and (ring or num_heads % k == 0) and k % s == 0
    ]


def ring_splits(k: int, num_heads: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The (Ulysses degree u, ring degree r) splits of an SP group of k ranks, u ascending:
    u divides k and the heads and is 1 or an allowed size (its sub-groups of u consecutive
    ranks are aligned blocks that exist), r = k / u."""
    return [(u, k // u) for u in range(1, k + 1) if k % u == 0 and num_heads % u == 0 and (u == 1 or u in sizes)]


def allowed_groups(cluster: ClusterSpec, num_heads: int, ring: bool = False) -> list[tuple[int, ...]]:
    """Every aligned block the runtime creates, in a fixed order (by size, then start rank):
    k ranks starting at a multiple of k, for every k of `group_sizes`."""
    out = []
    for k in group_sizes(cluster, num_heads, ring):
        for start in range(0, cluster.world_size - k + 1, k):
            out.append(tuple(range(start, start + k)))
    return out


def _is_pow2(x: int) -> bool:
    return x & (x - 1) == 0


def sp_chain(cluster: ClusterSpec, num_heads: int, ring: bool = False) -> list[int]:
    """The SP degrees the planners use: the longest chain of allowed sizes in which each
    divides the next (so groups of mixed sizes always tile the world when placed largest
    first at aligned offsets). Ties prefer powers of two."""
    sizes = group_sizes(cluster, num_heads, ring)
    best: dict[int, list[int]] = {}
    for k in sizes:  # ascending: longest chain ending at k
        cands = [best[j] + [k] for j in sizes if j < k and k % j == 0 and j in best]
        best[k] = max(cands, key=lambda c: (len(c), sum(map(_is_pow2, c)))) if cands else [k]
    return max(best.values(), key=lambda c: (len(c), c[-1], sum(map(_is_pow2, c))))


@dataclass(frozen=True)
class Topology:
    """The validated group geometry of one launch (see the module docstring)."""

    world_size: int
    gpus_per_node: int
    num_heads: int
    #: ranks per parameter-shard block (`ClusterSpec.shard_size`): no group is smaller
    shard_size: int = 1
    #: sizes need not divide the heads: a group runs Ulysses x ring attention (`splits`)
    ring: bool = False
    #: every allowed SP group size, ascending
    sizes: tuple[int, ...] = field(init=False)
    #: the divisibility chain of allowed sizes the planners mix within one step
    chain: tuple[int, ...] = field(init=False)
    #: the sizes `dcp` mixes within one step: every allowed size inside a node and the
    #: chain's beyond it (the chain itself where the sizes inside a node are one chain)
    mix: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1; got {self.num_heads}")
        cluster = self.cluster  # validates world size, whole nodes and the shard size
        sizes = tuple(group_sizes(cluster, self.num_heads, self.ring))
        if not sizes:
            raise ValueError(
                f"no SP group size of at least the shard size {self.shard_size} divides the model's "
                f"{self.num_heads} attention heads and fits {self.gpus_per_node}-GPU nodes (world "
                f"{self.world_size}); use a smaller shard_size (or 'auto')"
            )
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "chain", tuple(sp_chain(cluster, self.num_heads, self.ring)))
        g = self.gpus_per_node
        object.__setattr__(self, "mix", tuple(k for k in self.sizes if k <= g or k in self.chain))

    @staticmethod
    def of(cluster: ClusterSpec, num_heads: int, ring: bool | None = None) -> Topology:
        """The topology of ``cluster`` for a model of ``num_heads`` heads; ``ring`` None: the
        cluster's (`ClusterSpec.ring`)."""
        ring = cluster.ring if ring is None else ring
        return Topology(cluster.world_size, cluster.gpus_per_node, num_heads, cluster.shard_size, ring)

    def splits(self, k: int) -> list[tuple[int, int]]:
        """The (Ulysses, ring) degrees an SP group of k ranks may run (`ring_splits`); only
        (k, 1) without ``ring``; none for a size that is not allowed."""
        if k not in self.sizes:
            return []
        return ring_splits(k, self.num_heads, self.sizes) if self.ring else [(k, 1)]

    def measured_split(self, k: int) -> tuple[int, int]:
        """The split a profile measures an SP group of k ranks at first (`profiled_splits`), and
        the one an entry without a ring degree was measured at: the largest Ulysses degree, so
        ring 1 where k divides the heads and the fewest ring steps past them."""
        splits = self.splits(k)
        if not splits:
            raise ValueError(
                f"an SP group of {k} ranks is not allowed at world {self.world_size} with "
                f"{self.gpus_per_node} GPUs per node and {self.num_heads} heads; "
                f"sizes: {list(self.sizes)}"
            )
        return splits[-1]

    def profiled_splits(self, k: int) -> list[tuple[int, int]]:
        """The splits a profile measures an SP group of k ranks at: `measured_split` first and,
        with ring, the all-ring split (1, k) where it differs: the two extremes of `splits`
        (most all-to-all, most ring steps), so the profile grows by at most one split per size."""
        first, splits = self.measured_split(k), self.splits(k)
        return [first] + ([splits[0]] if splits[0] != first else [])

    @property
    def cluster(self) -> ClusterSpec:
        """A ClusterSpec with this geometry (link speeds and memory at their defaults)."""
        return ClusterSpec(
            world_size=self.world_size, gpus_per_node=self.gpus_per_node, shard_size=self.shard_size, ring=self.ring
        )

    def blocks(self) -> list[tuple[int, ...]]:
        """Every aligned block of an allowed size, by size then start rank (creation order)."""
        return allowed_groups(self.cluster, self.num_heads, self.ring)

    def is_block(self, ranks: Sequence[int]) -> bool:
        """Whether ``ranks`` is an aligned block of an allowed size."""
        k = len(ranks)
        return (
            k in self.sizes
            and ranks[0] % k == 0
            and ranks[-1] < self.world_size
            and tuple(ranks) == tuple(range(ranks[0], ranks[0] + k))
        )

    def static_sizes(self, usable: Sequence[int] | None = None) -> list[int]:
        """Chain sizes (among ``usable``) whose blocks alone tile the world."""
        pool = self.chain if usable is None else [k for k in self.chain if k in usable]
        return [k for k in pool if self.world_size % k == 0]

    def data_parallel(self, sp: int) -> list[tuple[int, ...]]:
        """The world cut into aligned blocks of ``sp`` ranks (a static layout's groups)."""
        if sp not in self.sizes or self.world_size % sp:
            raise ValueError(
                f"SP degree {sp} does not tile a world of {self.world_size} with blocks of an "
                f"allowed size (allowed: {list(self.sizes)}); use one of {self.static_sizes()}"
            )
        return [tuple(range(s, s + sp)) for s in range(0, self.world_size, sp)]

    def tile(self, sizes_desc: Sequence[int]) -> list[tuple[int, ...]]:
        """Aligned blocks for group sizes given largest first (in that order), then the ranks
        left uncovered as groups of one rank, ascending. Chain sizes are placed at consecutive
        offsets (a divisibility chain keeps each aligned); other sizes of `mix` are packed node
        by node (`fits`)."""
        if set(sizes_desc) <= set(self.chain):
            out, pos = [], 0
            for k in sizes_desc:
                if pos % k or pos + k > self.world_size:
                    raise ValueError(
                        f"group sizes {list(sizes_desc)} do not tile a world of {self.world_size} "
                        f"as aligned blocks: give chain sizes ({list(self.chain)}), largest first, "
                        f"summing to at most the world"
                    )
                out.append(tuple(range(pos, pos + k)))
                pos += k
            out.extend((r,) for r in range(pos, self.world_size))
            return out
        if list(sizes_desc) != sorted(sizes_desc, reverse=True):
            raise ValueError(f"group sizes {list(sizes_desc)} are not given largest first")
        counts: dict[int, int] = {}
        for k in sizes_desc:
            counts[k] = counts.get(k, 0) + 1
        packed = self._pack(counts)
        if packed is None:
            raise ValueError(
                f"group sizes {list(sizes_desc)} do not pack into a world of {self.world_size} "
                f"({self.gpus_per_node} GPUs per node) as aligned blocks of sizes {list(self.mix)}; "
                f"check `Topology.fits` before placing"
            )
        wide, runs = packed
        starts: dict[int, list[int]] = {}
        pos = 0
        for k in sizes_desc:
            if k > self.gpus_per_node:
                starts.setdefault(k, []).append(pos)
                pos += k
        node = pos
        for fill, repeats in runs:
            for _ in range(repeats):
                for k, off in fill:
                    starts.setdefault(k, []).append(node + off)
                node += self.gpus_per_node
        assert pos == wide
        taken = dict.fromkeys(starts, 0)  # the groups of each size placed so far: its slots in order
        out, used = [], [False] * self.world_size
        for k in sizes_desc:
            s = starts[k][taken[k]]
            taken[k] += 1
            out.append(tuple(range(s, s + k)))
            used[s : s + k] = [True] * k
        out.extend((r,) for r in range(self.world_size) if not used[r])
        return out

    def fits(self, counts: dict[int, int]) -> bool:
        """Whether groups of these sizes (size -> how many) are placed by `tile`: on a chain,
        whether they sum to at most the world; otherwise whether the node-by-node packing
        (`tile`) finds room for all of them."""
        if set(counts) <= set(self.chain):
            return sum(k * n for k, n in counts.items()) <= self.world_size
        return self._pack(counts) is not None

    def _pack(self, counts: dict[int, int]) -> tuple[int, list[tuple[list[tuple[int, int]], int]]] | None:
        """The packing `tile` places: the ranks the whole-node groups take (consecutive from
        rank 0, largest first), and the nodes after them as runs of alike nodes, each a fill
        ((size, offset in the node), ...) and how many nodes in a row take it; None if some
        group finds no room. A node is filled largest first, each group at the first aligned
        offset free; a fill repeats while every size it holds has that many groups left."""
        g = self.gpus_per_node
        if any(n and k not in self.mix for k, n in counts.items()):
            bad = sorted(k for k, n in counts.items() if n and k not in self.mix)
            raise ValueError(f"SP sizes {bad} are not among the sizes groups may mix here ({list(self.mix)})")
        wide = sum(k * n for k, n in counts.items() if k > g)
        if wide > self.world_size:
            return None
        cap = min(g, self.world_size)
        nodes = (self.world_size - wide) // cap
        rem = {k: n for k, n in sorted(counts.items(), reverse=True) if k <= g and n}
        runs: list[tuple[list[tuple[int, int]], int]] = []
        while rem:
            if nodes == 0:
                return None
            busy, fill, took = 0, [], {}
            for k, n in rem.items():
                block = (1 << k) - 1
                for off in range(0, cap - k + 1, k):
                    if took.get(k, 0) == n:
                        break
                    if not busy & (block << off):
                        busy |= block << off
                        fill.append((k, off))
                        took[k] = took.get(k, 0) + 1
            repeats = min(nodes, min(rem[k] // x for k, x in took.items()))
            runs.append((fill, repeats))
            nodes -= repeats
            for k, x in took.items():
                rem[k] -= x * repeats
            rem = {k: n for k, n in rem.items() if n}
        return wide, runs
