"""Policies by name: `--policy NAME` and `policy="NAME"` both resolve through `policy_spec`.

Three are for users (`POLICIES`: `dcp`, `bucket`, `packed`): the table every user surface
(`DataCentricParallel`, `DataCentricLoader`, `[train] policy`, `DataCentricArguments`, the
command line's defaults) accepts, through `user_policy`. The ablations of `dcp` and the
reproductions of other planners are research tools (`RESEARCH`): `dcparallel simulate` and
`dcparallel plan` take their names, the benchmarks and tests build them by name, and the
API and the loader run them only when asked with ``research=True``.

Policies that tune on the data or compare candidate plans need a plan's predicted step
time; the planning core does not simulate, so that **score** is passed in by the caller
(`dcparallel.sim.replay.step_seconds(ctx)` is the simulator's).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from dcparallel.plan import bucket, packed
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.portfolio import DcpPlanner, cyclic_gc_paused
from dcparallel.plan.dcp.static import static_layouts
from dcparallel.plan.research import flexsp, peers, token_budget
from dcparallel.plan.research.dcp_v1 import per_sample_row
from dcparallel.plan.splits import SplitPlanner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import Score, StepPlan, Tuned


class Planner(Protocol):
    name: str

    def plan(self, step: Step) -> StepPlan: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class PolicySpec:
    name: str
    description: str
    #: builds a planner for a workload from the epoch's steps (static baselines tune on them)
    build: Callable[[PlanContext, Sequence[Step], Score], Tuned]


def _dcp_portfolio(ctx: PlanContext, steps: Sequence[Step], score: Score) -> Tuned:
    """`dcp`: the portfolio, with the static baselines tuned on ``steps`` among its candidates
    (on steps of at most `DcpConfig.static_max_samples` samples) and what they need built ahead
    (`DcpPlanner.prepare`); built, like each step's plan, with the cycle collector paused
    (`cyclic_gc_paused`). A planner for an epoch (more than one step) then has the collector's
    young generations collected once: what the build made (its tables, the tuning's prices:
    166k and 217k objects on the CPU-time report's weak text/long and strong video-wide cells
    at 1024 GPUs) stays young until a collection moves it on, and the first that walks it
    (20-40 ms on this project's CPUs) would otherwise end the second or third step planned. A
    planner for one step (`dc.plan_batch`) is dropped after it: it skips this."""
    with cyclic_gc_paused():
        planner = DcpPlanner(ctx, score, static=static_layouts(ctx, steps, score))
        planner.prepare(steps)
    if len(steps) > 1:
        gc.collect(1)
    return Tuned(planner)


def _untuned(make: Callable[[PlanContext, Score], Planner]):
    return lambda ctx, steps, score: Tuned(make(ctx, score))


#: the policies users choose from: `DataCentricParallel(policy=...)`, `dcparallel train`
POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in [
        PolicySpec(
            "dcp",
            "ours: layouts by a makespan target (widens SP when a step has few samples per "
            "GPU), planned over (planning class, count) and group classes, two-phase steps; never predicted slower "
            "than the tuned bucket and packed plans, which it also offers (steps of <= 4096 samples)",
            _dcp_portfolio,
        ),
        PolicySpec(
            "bucket",
            "baseline: one SP degree + recompute setting (tuned on the data), "
            "per-bucket micro-batches dealt round-robin",
            bucket.tuned_bucket,
        ),
        PolicySpec(
            "packed",
            "baseline: one SP degree + recompute setting (tuned), token-capacity "
            "bins packed first-fit decreasing, dealt evenly",
            packed.tuned_packed,
        ),
    ]
}

#: research tools, reached by the same names (`simulate`, `plan`, the benchmarks): the paper's
#: ablations of `dcp` and reproductions of other systems' planners from their descriptions
RESEARCH: dict[str, PolicySpec] = {
    p.name: p
    for p in [
        PolicySpec(
            "bucket-default",
            "Open-Sora's default: smallest SP degree that fits the longest sample with full recompute (context only)",
            _untuned(lambda ctx, score: bucket.default_bucket(ctx)),
        ),
        PolicySpec(
            "dcp-own",
            "dcp without the static layouts it also offers: its own plans (mixed SP degrees, "
            "phases), for tests that exercise them",
            _untuned(DcpPlanner),
        ),
        PolicySpec(
            "dcp-intra",
            "per-bucket SP degree and micro-batch size, dealt by count",
            per_sample_row("dcp-intra", "fit", balance=False),
        ),
        PolicySpec(
            "dcp-inter",
            "dcp-intra + per-group gradient accumulation balancing the step",
            per_sample_row("dcp-inter", "fit", balance=True),
        ),
        PolicySpec(
            "dcp-inter-pac",
            "dcp-inter + per-micro-batch recompute from spare memory (knapsack)",
            per_sample_row("dcp-inter-pac", "pac", balance=True),
        ),
        PolicySpec(
            "dcp-v1",
            "per-sample dcp: dcp-inter-pac + two-phase steps (slow at scale, kept for comparison)",
            per_sample_row("dcp-v1", "pac", balance=True, phases=True),
        ),
        PolicySpec(
            "megatron-dcp",
            "reproduction of Megatron-Core's dynamic CP from its description: CP size = "
            "next power of two of tokens / rank capacity, packed, balanced per CP size",
            peers.build_megatron,
        ),
        PolicySpec(
            "hbp",
            "reproduction of hierarchical balance packing from its description: three packing "
            "lengths, each with its own SP degree and checkpointing, packs balanced",
            peers.build_hbp,
        ),
        PolicySpec(
            "flexsp",
            "reproduction of FlexSP's optimal assignment from its description: a MILP picks "
            "heterogeneous SP groups and assigns bucketed samples to them (small clusters: solver-bound)",
            _untuned(lambda ctx, score: flexsp.FlexSPPlanner(ctx)),
        ),
        PolicySpec(
            "token-budget",
            "reproduction of RL frameworks' dynamic batch size from its description: one SP "
            "degree (the longest sample's), full recompute, equal sample counts per data-parallel group, "
            "token-budget micro-batches, the same micro-batch count on every group",
            token_budget.build_token_budget,
        ),
    ]
}

#: every name `policy_spec` resolves: the user policies, then the research ones
NAMES: tuple[str, ...] = (*POLICIES, *RESEARCH)

#: the policies `--all` runs, baselines first
ALL = ["bucket-default", "bucket", "packed", "dcp-intra", "dcp-inter", "dcp-inter-pac", "dcp"]

#: the user policies in the order comparisons list them (`simulate`'s default, the demo):
#: the static baselines, then `dcp`
COMPARED: tuple[str, ...] = (*(n for n in POLICIES if n != "dcp"), "dcp")


def policy_spec(name: str) -> PolicySpec:
    """The policy called ``name``, a user policy or a research one; a clear error otherwise."""
    spec = POLICIES.get(name) or RESEARCH.get(name)
    if spec is None:
        raise ValueError(
            f"unknown policy {name!r}; choose one of {', '.join(POLICIES)} (research: {', '.join(RESEARCH)})"
        )
    return spec


def user_policy(name: str, where: str, *, research: bool = False, flag: str | None = "research=True") -> PolicySpec:
    """The policy ``name`` given to a user surface (``where``, as the error names it): one of
    `POLICIES`, or with ``research`` (the surface's explicit flag, spelled ``flag`` in the
    error; None where the surface has none) also a research one. Anything else is a
    ValueError naming the value, the user table and where a research policy runs."""
    if name in POLICIES or (research and name in RESEARCH):
        return policy_spec(name)
    users = ", ".join(POLICIES)
    if name in RESEARCH:
        also = f", or pass {flag}" if flag else ""
        raise ValueError(
            f"{where}: {name!r} is a research policy (an ablation of dcp or a reproduction of another "
            f"system's planner), not one users train with; choose one of {users}. Research policies run in "
            f"`dcparallel simulate --policy {name}` and `dcparallel plan --policy {name}`{also}"
        )
    more = f" (research: {', '.join(RESEARCH)})" if research else ""
    raise ValueError(f"{where}: unknown policy {name!r}; choose one of {users}{more}")


def tune(name: str, ctx: PlanContext, steps: Sequence[Step] = (), *, score: Score) -> Tuned:
    """Builds policy ``name``'s planner (tuning it on ``steps`` where it tunes); where the
    cluster allows ring, its plans get each micro-batch's priced split (`splits`)."""
    tuned = policy_spec(name).build(ctx, steps, score)
    if ctx.topology.ring:
        return Tuned(SplitPlanner(tuned.planner, ctx), tuned.tried)
    return tuned


def make_planner(name: str, ctx: PlanContext, steps: Sequence[Step] = (), *, score: Score) -> Planner:
    return tune(name, ctx, steps, score=score).planner
