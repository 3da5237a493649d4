"""Steps planned from in-memory rollouts: lengths exchanged, one plan, one all-to-all.

In an RL loop every rank holds the rollouts it just generated (`data.rollouts`). A step
is planned from them in three moves, the same on every rank:

1. one all-gather of each rank's `Holdings` (token and trained-token counts, the schema),
   no payload: every rank then knows every rollout's length and its global id
   (rank-major, `data.rollouts.owners`);
2. the policy plans the step over those lengths (a pure function of them, the cost model,
   the cluster and the policy, so every rank gets the same plan without talking; compared
   across ranks on the first step and every ``check_plans`` steps). A step's planner is built
   on that step's lengths (its classes are sized by the step's longest samples), but the
   layouts it prices — micro-batches of copies of one length — are a function of the length
   alone on a fixed cost model, so they are kept across steps (`LAYOUT_CACHE_LIMIT`) and a
   step prices only lengths no earlier step met;
3. one variable-size all-to-all of the packed rollouts: each goes whole to every rank of
   the SP group that runs it (`data.rollouts.routes`), and each rank collates its
   micro-batches (`data.rollouts.rollout_batch`: per-token tensors cut like the tokens).

The `RolloutStep` it returns is used like a loader step: for batch in step: forward, loss,
backward; then `sync_gradients` and the optimizer. ``plan_seconds`` and
``exchange_seconds`` time moves 1-2 and 3 on this rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dcparallel.cost.base import CACHE_LIMIT, CostModel
from dcparallel.data import plan_check
from dcparallel.data.batch import Batch
from dcparallel.data.rollouts import (
    Holdings,
    Schema,
    nbytes,
    owners,
    pack,
    read_rollouts,
    rollout_batch,
    routes,
    unpack,
)
from dcparallel.data.transport import stamp
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import StepPlan
from dcparallel.runtime import comm
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import ClusterSpec, Workload

#: `PlanContext.copies_layout`'s results kept across steps: emptied before a step past this
#: many (a few tens of thousands are met per step at 1024 GPUs; the plans do not depend on it)
LAYOUT_CACHE_LIMIT = CACHE_LIMIT


@dataclass(frozen=True)
class RolloutStep:
    """This rank's part of one step planned from rollouts: its `Batch`es in order."""

    index: int
    """steps planned so far by this planner (0-based)"""
    rank: int
    plan: StepPlan
    """the whole plan over global ids; identical on every rank"""
    batches: tuple[Batch, ...]
    origin: tuple[tuple[int, int], ...]
    """global id -> (rank that holds the rollout, its index in that rank's list)"""
    local_ids: tuple[int, ...]
    """the global ids of this rank's own rollouts, in the order it gave them"""
    lengths: tuple[int, ...]
    """tokens of every rollout of the step, by global id"""
    num_targets: int
    """trained tokens of the whole step (every rank's rollouts)"""
    plan_seconds: float
    """this rank's seconds in the length exchange and planning"""
    exchange_seconds: float
    """this rank's seconds moving and collating the rollouts"""

    @property
    def num_samples(self) -> int:
        """Rollouts in the whole step, over all ranks: a per-sequence mean's normalizer."""
        return len(self.origin)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def agree_schema(everyone: Sequence[Holdings]) -> Schema:
    """The schema every rank that holds rollouts gave; a ValueError naming the ranks otherwise."""
    schemas = {r: h.schema for r, h in enumerate(everyone) if h.schema is not None}
    if not schemas:
        raise ValueError(
            "no rank holds a rollout: there is nothing to plan; give plan_batch this rank's rollouts "
            "(an empty list on a rank that generated none)"
        )
    first = next(iter(schemas.values()))
    odd = sorted(r for r, s in schemas.items() if s != first)
    if odd:
        raise ValueError(
            f"ranks {odd} give rollouts with fields {schemas[odd[0]].fields}, rank "
            f"{min(schemas)} gives {first.fields}: every rank must give the same per-token tensors "
            f"with the same dtypes"
        )
    return first


class RolloutPlanner:
    """Plans each step from the ranks' rollouts with one policy (see the module docstring).
    ``device``: where the batches go (the model's device). ``max_tokens``: the longest rollout
    to expect, checked here to fit some layout (`NoLayoutFits` otherwise), before any step.
    Every rank calls `plan` together."""

    def __init__(
        self,
        cost: CostModel,
        cluster: ClusterSpec,
        policy: str,
        *,
        device: torch.device | None = None,
        check_plans: int = plan_check.CHECK_PLANS_EVERY,
        max_tokens: int | None = None,
    ):
        self.cost, self.cluster, self.policy, self.device = cost, cluster, policy, device
        self.check_plans = plan_check.check_every(check_plans)
        self.rank, self.world_size = comm.world_rank(), comm.world_size()
        self.steps = 0
        self._layouts: dict = {}  # see the module docstring, move 2
        self._state_bytes = cost.model_state_bytes()  # the layouts kept were priced with these states
        if max_tokens is not None:
            try:
                PlanContext(Workload(cost.model, (int(max_tokens),)), cost, cluster)
            except ValueError as e:
                raise ValueError(f"max_tokens={max_tokens}: {e}") from None

    def plan_step(self, lengths: Sequence[int], index: int) -> tuple[StepPlan, PlanContext]:
        """The policy's plan of one step over these global lengths (pure: no collective)."""
        state = self.cost.model_state_bytes()
        if len(self._layouts) >= LAYOUT_CACHE_LIMIT or state != self._state_bytes:
            self._layouts.clear()
            self._state_bytes = state
        try:
            ctx = PlanContext(Workload(self.cost.model, tuple(lengths)), self.cost, self.cluster, layouts=self._layouts)
        except ValueError as e:
            raise ValueError(f"{e} (a rollout's sample id is global: rank-major over the ranks' rollouts)") from None
        planner = make_planner(self.policy, ctx, [Step(index, tuple(range(len(lengths))))], score=step_seconds(ctx))
        plan = planner.plan(Step(index, tuple(range(len(lengths)))))
        plan.check_samples()  # each rollout planned once: none dropped from the step, none twice
        plan.check_shard_blocks(self.cluster.shard_size)
        return plan, ctx

    def plan(self, samples: Sequence[Mapping[str, Tensor]]) -> RolloutStep:
        t0 = time.perf_counter()
        everyone: list[Holdings] = comm.all_gather_object(read_rollouts(samples))
        schema = agree_schema(everyone)
        counts = [len(h.lengths) for h in everyone]
        lengths = [n for h in everyone for n in h.lengths]
        index = self.steps
        plan, _ = self.plan_step(lengths, index)
        if self.check_plans and (index == 0 or index % self.check_plans == 0):
            plan_check.check_same_plan(plan, 0, index)
        t1 = time.perf_counter()
        owner = owners(counts)
        offset = sum(counts[: self.rank])
        received = self._exchange(plan, owner, lengths, schema, {offset + j: s for j, s in enumerate(samples)})
        work = plan.work_of(self.rank)
        batches = tuple(
            stamp(rollout_batch(mb, ranks, self.rank, received), index, j == len(work) - 1, self.device)
            for j, (mb, ranks) in enumerate(work)
        )
        self.steps += 1
        origin = tuple((r, j) for r, n in enumerate(counts) for j in range(n))
        return RolloutStep(
            index,
            self.rank,
            plan,
            batches,
            origin,
            tuple(range(offset, offset + len(samples))),
            tuple(lengths),
            sum(t for h in everyone for t in h.targets),
            t1 - t0,
            time.perf_counter() - t1,
        )

    def _exchange(
        self,
        plan: StepPlan,
        owner: list[int],
        lengths: list[int],
        schema: Schema,
        mine: dict[int, Mapping[str, Tensor]],
    ) -> dict[int, dict[str, Tensor]]:
        """Every rollout this rank's micro-batches need, whole, by global id (one all-to-all)."""
        sends = routes(plan, owner, self.world_size)
        parts = [pack(mine, ids, schema) for ids in sends[self.rank]]
        recv = [nbytes(sends[src][self.rank], lengths, schema) for src in range(self.world_size)]
        if self.device is not None and self.device.type == "cuda":  # NCCL moves device buffers
            parts = [p.to(self.device) for p in parts]
        got = comm.all_to_all_bytes(parts, recv)
        received: dict[int, dict[str, Tensor]] = {}
        for src, buf in enumerate(got):
            received.update(unpack(buf.cpu(), sends[src][self.rank], lengths, schema))
        return received
