"""``shard_size="auto"``: the smallest parameter-shard block size with which a model fits
(`auto_shard_size`), and the sentence that says why (`explain_shard_size`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.base import CostModel
from dcparallel.spec import ClusterSpec, ModelSpec, Recompute, Size, format_bytes
from dcparallel.topology import Topology


def _count(n: float) -> str:
    """A parameter count: 70.55B, 350.2M, 133,440."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{int(n):,}"


def smallest_need(cost: CostModel, size: Size, sp: int) -> float:
    """Peak bytes of one sample alone at SP ``sp`` with full recomputation."""
    L = cost.model.num_layers
    return cost.terms((size,), sp).memory(Recompute(L, L))


def auto_shard_size(
    model: ModelSpec,
    cluster: ClusterSpec,
    sizes: Sequence[Size] | None = None,
    *,
    make_cost: Callable[[ModelSpec, ClusterSpec], CostModel] | None = None,
) -> int:
    """``shard_size="auto"``: the smallest shard size (of `ClusterSpec.shard_sizes`) with which
    the model states and the smallest micro-batch fit the memory budget — the smallest sample of
    ``sizes`` alone on a group of s ranks with full recomputation — and with which the largest
    sample still fits some layout (alone on the widest SP group, full recomputation), so that
    the epoch can be planned. Without ``sizes`` only the model states (with the gathered
    parameters) must fit. ``make_cost`` builds the cost model for each candidate
    (default `AnalyticCost`). A shard size is tried where some SP group of at least that many
    ranks divides the heads, or, with the cluster's `ring`, where the world has such a group
    (Ulysses x ring: the group need not divide them). A ValueError names the model, the memory
    the largest shard size still needs and what is available, and the fixes (ring attention
    among them where it would allow shard sizes not tried)."""
    make_cost = make_cost or AnalyticCost
    budget = float(cluster.memory_bytes)
    smallest = largest = None
    if sizes:
        smallest = min(sizes, key=model.tokens)
        largest = max(sizes, key=model.tokens)
    need, why, tried, refused, undivided = 0.0, "", [], [], []
    candidates = cluster.shard_sizes()
    for s in candidates:
        c = dataclasses.replace(cluster, shard_size=s)
        try:
            top = Topology.of(c, model.num_heads)
        except ValueError:
            undivided.append(s)  # no SP group of at least s ranks divides the heads (ring allows them)
            continue
        try:
            cost = make_cost(model, c)
        except ValueError as e:  # e.g. a profile measured at another shard size
            refused.append(f"shard size {s}: {e}")
            continue
        tried.append(s)
        need = cost.model_state_bytes()
        why = "its model states"
        if smallest is not None:
            need = smallest_need(cost, smallest, top.sizes[0])
            why = f"its smallest sample ({smallest!r}) alone at SP {top.sizes[0]} with full recomputation"
        if need > budget:
            continue
        if largest is not None:
            need_l = smallest_need(cost, largest, top.sizes[-1])
            if need_l > budget:
                need, why = need_l, f"its largest sample ({largest!r}) at SP {top.sizes[-1]} with full recomputation"
                continue
        return s
    if not tried and refused:
        raise ValueError(f"no shard size could be priced for model {model.name!r}: " + "; ".join(refused))
    if not tried:
        raise ValueError(
            f"model {model.name!r} has {model.num_heads} attention heads, which no SP group of at least "
            f"the shard sizes {candidates} divides on this cluster; use a world or node size whose "
            f"groups divide the heads, or ring attention (ring=True, `--ring`), whose groups need not"
        )
    raise ValueError(_does_not_fit(model, cluster, tried, f"{why} needs {format_bytes(need)}", undivided))


def _does_not_fit(model: ModelSpec, cluster: ClusterSpec, tried: list[int], needs: str, undivided: list[int]) -> str:
    """`auto_shard_size`'s message where no shard size tried fits: what the largest still
    `needs`, and the fixes (ring attention where it would allow the shard sizes `undivided`,
    not tried because no SP group of that many ranks divides the heads)."""
    fixes = "GPUs with more memory, or shorter samples"
    if undivided:  # (only without ring: with it every group size is allowed)
        fixes = (
            f"GPUs with more memory, shorter samples, or ring attention (ring=True, `--ring`), whose SP "
            f"groups past the {model.num_heads} heads allow the shard sizes {undivided} not tried"
        )
    return (
        f"model {model.name!r} ({_count(model.num_params)} parameters) does not fit {cluster.world_size} GPUs of "
        f"{format_bytes(cluster.memory_bytes)} usable memory at any shard size (tried {tried}): at shard size "
        f"{tried[-1]} {needs} per rank. Use more GPUs (the optimizer states shrink with the world, parameters "
        f"and gradients with the shard size), {fixes}"
    )


def explain_shard_size(
    model: ModelSpec,
    cluster: ClusterSpec,
    sizes: Sequence[Size] | None = None,
    *,
    make_cost: Callable[[ModelSpec, ClusterSpec], CostModel] | None = None,
) -> tuple[int, str]:
    """(`auto_shard_size`'s choice, the sentence that says why), e.g. ``shard_size auto -> 2:
    model states 3.10 GiB per rank at s=1 exceed the memory budget 2.00 GiB; at s=2: 1.60 GiB``."""
    s = auto_shard_size(model, cluster, sizes, make_cost=make_cost)
    make_cost = make_cost or AnalyticCost
    smallest = min(sizes, key=model.tokens) if sizes else None
    budget = float(cluster.memory_bytes)

    def need(k: int) -> float | None:
        c = dataclasses.replace(cluster, shard_size=k)
        try:
            cost, top = make_cost(model, c), Topology.of(c, model.num_heads)
        except ValueError:  # no SP group of this shard size divides the heads, or no cost model
            return None
        return cost.model_state_bytes() if smallest is None else smallest_need(cost, smallest, top.sizes[0])

    what = "model states" if smallest is None else f"model states + the smallest sample ({smallest!r}) alone"
    head = f"shard_size auto -> {s}: {what}"
    below = [k for k in cluster.shard_sizes() if k < s]
    at_s = f"{format_bytes(need(s))} per rank at s={s}"
    if not below:
        return s, f"{head} need {at_s}, within the memory budget {format_bytes(budget)}"
    k = below[0]
    n = need(k)
    if n is None:
        why = f"cannot be planned at s={k} (no SP group of {k} ranks divides the {model.num_heads} heads)"
    elif n > budget:
        last = need(below[-1]) if below[-1] != k else None
        also = f" ({format_bytes(last)} at s={below[-1]})" if last is not None else ""
        why = f"need {format_bytes(n)} per rank at s={k}{also}, over the memory budget {format_bytes(budget)}"
    else:
        why = (
            f"fit at s={k} but the largest sample does not fit any layout below s={s} within the memory "
            f"budget {format_bytes(budget)}"
        )
    return s, f"{head} {why}; {at_s}"
