"""Policies by name: one table that `--policy NAME` and `policy="NAME"` both resolve through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from dcparallel.plan import bucket, dcp_full, dcp_inter, dcp_inter_pac, dcp_intra, dcp_scale, packed, peers
from dcparallel.plan.context import PlanContext
from dcparallel.plan.steps import Step
from dcparallel.plan.types import StepPlan


class Planner(Protocol):
    name: str

    def plan(self, step: Step) -> StepPlan: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class PolicySpec:
    name: str
    description: str
    #: builds a planner for a workload; gets the epoch's steps (static baselines tune on them)
    build: Callable[[PlanContext, Sequence[Step]], Planner]


POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in [
        PolicySpec("bucket", "baseline: one SP degree + recompute setting (tuned on the data), "
                   "per-bucket micro-batches dealt round-robin", bucket.tuned_bucket),
        PolicySpec("bucket-default", "Open-Sora's default: smallest SP degree that fits the longest "
                   "sample with full recompute (context only)", bucket.default_bucket),
        PolicySpec("packed", "baseline: one SP degree + recompute setting (tuned), token-capacity "
                   "bins packed first-fit decreasing, dealt evenly", packed.tuned_packed),
        PolicySpec("dcp-intra", "per-bucket SP degree and micro-batch size, dealt by count", dcp_intra.build),
        PolicySpec("dcp-inter", "dcp-intra + per-group gradient accumulation balancing the step",
                   dcp_inter.build),
        PolicySpec("dcp-inter-pac", "dcp-inter + per-micro-batch recompute from spare memory (knapsack)",
                   dcp_inter_pac.build),
        PolicySpec("dcp-v1", "the previous dcp: dcp-inter-pac + two-phase steps (per-sample planning; "
                   "slow at scale, kept for comparison)", dcp_full.build),
        PolicySpec("megatron-dcp", "reproduction of Megatron-Core's dynamic CP from its description: CP size = "
                   "next power of two of tokens / rank capacity, packed, balanced per CP size", peers.build_megatron),
        PolicySpec("hbp", "reproduction of hierarchical balance packing from its description: three packing "
                   "lengths, each with its own SP degree and checkpointing, packs balanced", peers.build_hbp),
        PolicySpec("dcp", "ours: layouts by a makespan target (widens SP when a step has few samples per "
                   "GPU), planned over (bucket, count) and group classes, two-phase steps", dcp_scale.build),
    ]
}

#: the policies `--all` runs, baselines first
ALL = ["bucket-default", "bucket", "packed", "dcp-intra", "dcp-inter", "dcp-inter-pac", "dcp"]


def make_planner(name: str, ctx: PlanContext, steps: Sequence[Step] = ()) -> Planner:
    spec = POLICIES.get(name)
    if spec is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return spec.build(ctx, steps)
