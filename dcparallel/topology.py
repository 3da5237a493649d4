"""`Topology`: the one owner of the group geometry — allowed SP sizes, their chain, tilings, data-parallel blocks.

Every consumer of group shapes takes a `Topology`: the planners (through
`PlanContext.topology`), the simulator, the profiler and the runtime's
`ProcessGroups`. A group is an *aligned block*: ``k`` consecutive ranks starting at a
multiple of ``k``. The rules, for a world of whole nodes of ``gpus_per_node`` GPUs and a
model of ``num_heads`` attention heads (Ulysses splits heads, so ``k`` divides them):

- **allowed sizes** (`sizes`): ``k`` divides the GPUs per node (a group inside one node) or
  is a multiple of a node (whole nodes), and divides the heads;
- **the chain** (`chain`): the longest run of allowed sizes in which each divides the next.
  Groups of chain sizes placed largest first at consecutive offsets are always aligned,
  so any mix of them tiles the world (`tile`);
- **static sizes** (`static_sizes`): chain sizes whose blocks tile the world alone (the
  static baselines' data-parallel blocks, `data_parallel`).

Pure python: no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dcparallel.spec import ClusterSpec


def group_sizes(cluster: ClusterSpec, num_heads: int) -> list[int]:
    """Every allowed SP degree: k divides the GPUs per node or is a multiple of a node,
    divides the attention heads, and at least one aligned block of k ranks fits the world."""
    g = cluster.gpus_per_node
    return [k for k in range(1, cluster.world_size + 1) if (g % k == 0 or k % g == 0) and num_heads % k == 0]


def allowed_groups(cluster: ClusterSpec, num_heads: int) -> list[tuple[int, ...]]:
    """Every aligned block the runtime creates, in a fixed order (by size, then start rank):
    k ranks starting at a multiple of k, for every k of `group_sizes`."""
    out = []
    for k in group_sizes(cluster, num_heads):
        for start in range(0, cluster.world_size - k + 1, k):
            out.append(tuple(range(start, start + k)))
    return out


def _is_pow2(x: int) -> bool:
    return x & (x - 1) == 0


def sp_chain(cluster: ClusterSpec, num_heads: int) -> list[int]:
    """The SP degrees the planners use: the longest chain of allowed sizes in which each
    divides the next (so groups of mixed sizes always tile the world when placed largest
    first at aligned offsets). Ties prefer powers of two."""
    sizes = group_sizes(cluster, num_heads)
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
    #: every allowed SP group size, ascending
    sizes: tuple[int, ...] = field(init=False)
    #: the divisibility chain of allowed sizes the planners mix within one step
    chain: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1; got {self.num_heads}")
        cluster = self.cluster  # validates world size and whole nodes
        object.__setattr__(self, "sizes", tuple(group_sizes(cluster, self.num_heads)))
        object.__setattr__(self, "chain", tuple(sp_chain(cluster, self.num_heads)))

    @staticmethod
    def of(cluster: ClusterSpec, num_heads: int) -> Topology:
        return Topology(cluster.world_size, cluster.gpus_per_node, num_heads)

    @property
    def cluster(self) -> ClusterSpec:
        """A ClusterSpec with this geometry (link speeds and memory at their defaults)."""
        return ClusterSpec(world_size=self.world_size, gpus_per_node=self.gpus_per_node)

    def blocks(self) -> list[tuple[int, ...]]:
        """Every aligned block of an allowed size, by size then start rank (creation order)."""
        return allowed_groups(self.cluster, self.num_heads)

    def is_block(self, ranks: Sequence[int]) -> bool:
        """Whether ``ranks`` is an aligned block of an allowed size."""
        k = len(ranks)
        return (k in self.sizes and ranks[0] % k == 0 and ranks[-1] < self.world_size
                and tuple(ranks) == tuple(range(ranks[0], ranks[0] + k)))

    def static_sizes(self, usable: Sequence[int] | None = None) -> list[int]:
        """Chain sizes (among ``usable``) whose blocks alone tile the world."""
        pool = self.chain if usable is None else [k for k in self.chain if k in usable]
        return [k for k in pool if self.world_size % k == 0]

    def data_parallel(self, sp: int) -> list[tuple[int, ...]]:
        """The world cut into aligned blocks of ``sp`` ranks (a static layout's groups)."""
        if sp not in self.sizes or self.world_size % sp:
            raise ValueError(f"SP degree {sp} does not tile a world of {self.world_size} with blocks of an "
                             f"allowed size (allowed: {list(self.sizes)}); use one of {self.static_sizes()}")
        return [tuple(range(s, s + sp)) for s in range(0, self.world_size, sp)]

    def tile(self, sizes_desc: Sequence[int]) -> list[tuple[int, ...]]:
        """Aligned blocks for group sizes of the chain given largest first, placed at
        consecutive offsets (a divisibility chain keeps each aligned); ranks left uncovered
        become groups of one rank."""
        out, pos = [], 0
        for k in sizes_desc:
            if pos % k or pos + k > self.world_size:
                raise ValueError(f"group sizes {list(sizes_desc)} do not tile a world of {self.world_size} "
                                 f"as aligned blocks: give chain sizes ({list(self.chain)}), largest first, "
                                 f"summing to at most the world")
            out.append(tuple(range(pos, pos + k)))
            pos += k
        out.extend((r,) for r in range(pos, self.world_size))
        return out
