"""The per-sample packing's groups (`sample.SamplePacker`): a group while packing (`Node`) and
packed (`Group`), a step's packing (`Packing`), and the step plan of packed groups
(`step_plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from dcparallel.plan.assemble import assemble
from dcparallel.plan.steps import Step
from dcparallel.plan.types import GroupPlan, StepPlan, micro_batches
from dcparallel.spec import Layout, Recompute

if TYPE_CHECKING:
    from dcparallel.plan.context import PlanContext


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


class Prices(NamedTuple):
    """What a packing's micro-batches were priced at (`sample.SamplePacker.times`): per
    micro-batch (its sample ids) its grid and row there, on `ctx`'s degrees `sp` with
    recompute `mode`; and the layouts made so far (equal layouts are one object, shared)."""

    ctx: PlanContext
    sp: list[int]
    mode: str
    priced: dict
    layouts: dict


def step_plan(prices: Prices, step: Step, groups: list[Group], times: list[float] | None = None) -> StepPlan:
    """The step plan of packed groups: the top-level groups placed as aligned blocks
    (widest first), each sub-group on its slice of its parent's block one phase earlier
    (the top-level groups run in the last phase); ranks without a group in a phase idle.
    `times`, if given, is filled with each micro-batch's time as `prices` has it, in the
    plan's order (the groups', then each group's): the micro-batch at its layout, as
    `PlanContext.mb_costs` prices it (the same arithmetic), for the score."""
    last = max((_depth(g) for g in groups), default=1) - 1
    out: list[GroupPlan] = []
    priced: dict[int, list[float]] = {}
    rows: dict[int, tuple[list, list, list]] = {}  # per grid priced: its rows as lists (read once each)
    for g, ranks in zip(groups, prices.ctx.topology.tile([g.sp for g in groups])):
        _emit(prices, g, ranks, last, out, (priced, rows))
    plan = assemble(prices.ctx, step, out, by_rank=True)
    if times is not None:
        for gp in plan.groups:
            if gp.micro_batches:
                times.extend(priced[id(gp)])
    return plan


def _emit(prices: Prices, g: Group, ranks: tuple[int, ...], phase: int, out: list[GroupPlan], memo: tuple) -> None:
    """Group g (on `ranks`, in `phase`) and its sub-groups as `GroupPlan`s, appended to
    `out`; `memo`: each one's micro-batch times (by the group's id: `out` holds the
    group, so its id stays its own) and the grids' rows as lists."""
    k, items, kids = g.sp, g.items, g.subgroups
    if items:
        lays, ts = _layouts_of(prices, items, k, memo[1])
        gp = GroupPlan(ranks, tuple(micro_batches(zip(items, lays))), phase)
        out.append(gp)
        memo[0][id(gp)] = ts
    w = k // max(len(kids), 1)
    for c, kid in enumerate(kids):
        _emit(prices, kid, ranks[c * w : (c + 1) * w], phase - 1, out, memo)


def _layouts_of(prices: Prices, items: list[tuple[int, ...]], k: int, rows: dict) -> tuple[list[Layout], list[float]]:
    """The layouts priced for micro-batches at degree k and their times there (else
    `layout_for`'s); `rows`: the grids' rows as lists, per grid, filled as met."""
    d, ctx, lays, ts = prices.sp.index(k), prices.ctx, [], []
    priced, layouts = prices.priced.get, prices.layouts
    grid = lists = None  # the grid last met (a step's micro-batches are mostly of one) and its rows
    for item in items:
        got = priced(item)
        if got is None:
            fit = ctx.layout_for(tuple(ctx.sizes[i] for i in item), k, prices.mode)
            lays.append(fit.layout)
            ts.append(fit.time)
            continue
        fits, a = got
        if fits is not grid:
            grid, lists = fits, rows.get(id(fits))
            if lists is None:  # (`priced` holds the grid: its id stays its own)
                lists = rows[id(fits)] = (fits.time.tolist(), fits.attn.tolist(), fits.mlp.tolist())
        key = (k, len(item), lists[1][a][d], lists[2][a][d])
        lay = layouts.get(key)
        if lay is None:
            lay = layouts[key] = Layout(k, len(item), Recompute(key[2], key[3]))
        lays.append(lay)
        ts.append(lists[0][a][d])
    return lays, ts


def _depth(g: Group) -> int:
    """Levels of a packed group: 1 without sub-groups."""
    return 1 + max((_depth(c) for c in g.subgroups), default=0)
