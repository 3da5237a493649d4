"""Forward-only passes over the ranks' rollouts, planned as such, outputs sent back.

Old-policy, reference and value passes run over the same rollouts as the update, so they
are as unbalanced when each rank runs its own. `ForwardPass.run` plans the pass like a
training step (`runtime.rollout_step`: lengths all-gathered, one plan, one all-to-all of
the rollouts) but with the forward-only cost model (`cost.forward.ForwardOnlyCost`: no
activations kept, no recompute, so bigger micro-batches), runs each micro-batch forward
under ``torch.no_grad`` on the same SP groups (Ulysses attention, the engine's process
groups), and sends every rank's shard of each output back to the rank that holds the
rollout: a second variable-size all-to-all, whose sizes every rank knows from the plan
(`data.rollouts.shard_pieces`). The result is one float32 tensor per rollout of this rank,
in the order it gave them, aligned with its ``input_ids``: entry t is the output for token
t (entry 0, which nothing predicts, is 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dcparallel.cost.base import CostModel
from dcparallel.cost.forward import ForwardOnlyCost
from dcparallel.data.batch import Batch
from dcparallel.data.rollouts import Piece, shard_pieces
from dcparallel.plan.types import StepPlan
from dcparallel.runtime import comm
from dcparallel.runtime.rollout_step import RolloutPlanner, RolloutStep
from dcparallel.runtime.sharded import check_group
from dcparallel.runtime.ulysses import check_heads
from dcparallel.spec import ClusterSpec, Recompute

#: fn(model, batch) -> (B, Ls) per-position outputs of a micro-batch, aligned with
#: ``batch.labels`` (position p: the output for the token predicted at p)
ForwardFn = Callable[[Any, Batch], Tensor]


class ForwardPass:
    """Plans and runs forward-only passes on ``engine`` (see the module docstring). Every
    rank calls `run` together, each with its own rollouts (maybe none)."""

    def __init__(
        self,
        engine: Any,
        cost: CostModel,
        cluster: ClusterSpec,
        policy: str,
        *,
        device: torch.device | None = None,
        check_plans: int = 50,
    ):
        self.engine = engine
        self.planner = RolloutPlanner(ForwardOnlyCost(cost), cluster, policy, device=device, check_plans=check_plans)
        #: the last pass's step (its plan, timings), for reports
        self.last_step: RolloutStep | None = None

    @contextlib.contextmanager
    def _forward(self, batch: Batch) -> Iterator[None]:
        """The batch's SP group in attention, nothing recomputed, no autograd graph."""
        e = self.engine
        assert e.rank in batch.ranks, (e.rank, batch.ranks)
        check_heads(e.num_heads, batch.sp)
        check_group(batch.ranks, e.shard_size)
        e.attention.activate(e.groups.group(batch.ranks), batch.cu_seqlens, batch)
        e.recompute.set(Recompute.none())
        try:
            with torch.no_grad():
                yield
        finally:
            e.attention.deactivate()

    def run(self, samples: Sequence[Mapping[str, Tensor]], fn: ForwardFn) -> list[Tensor]:
        """``fn``'s per-token outputs over this rank's ``samples`` (module docstring)."""
        step = self.planner.plan(samples)
        self.last_step = step
        pieces: list[tuple[Piece, Tensor]] = []
        for batch, (mb, _) in zip(step, step.plan.work_of(step.rank), strict=True):
            with self._forward(batch):
                y = fn(self.engine.model, batch)
            if y.dim() != 2 or tuple(y.shape) != tuple(batch.inputs.shape[:2]):
                raise ValueError(
                    f"the forward function returned shape {tuple(y.shape)}; give one value per token "
                    f"position, shaped like batch.inputs {tuple(batch.inputs.shape[:2])}"
                )
            at = 0  # the pieces lie in sample order along the shard's one row
            for p in shard_pieces(mb, batch.rank_in_group, step.lengths):
                pieces.append((p, y[0, at : at + p.hi - p.lo].detach().float().cpu()))
                at += p.hi - p.lo
        return self._send_back(step, pieces)

    def _send_back(self, step: RolloutStep, pieces: list[tuple[Piece, Tensor]]) -> list[Tensor]:
        """Each output piece to the rank holding its rollout (one all-to-all); assembled."""
        world, rank = self.planner.world_size, self.planner.rank
        lengths = step.lengths
        owner = [r for r, _ in step.origin]
        parts = [
            torch.cat([v for p, v in pieces if owner[p.sample] == dst] or [torch.empty(0)]) for dst in range(world)
        ]
        expect = [expected_pieces(step.plan, src, lengths, owner, rank) for src in range(world)]
        got = comm.all_to_all_bytes(
            [p.contiguous().view(torch.uint8) for p in parts], [4 * sum(p.hi - p.lo for p in e) for e in expect]
        )
        out = {i: torch.zeros(lengths[i], dtype=torch.float32) for i in step.local_ids}
        for buf, exp in zip(got, expect, strict=True):
            vals, at = buf.cpu().view(torch.float32), 0
            for p in exp:
                v = vals[at : at + p.hi - p.lo]
                at += p.hi - p.lo
                keep = min(p.hi, lengths[p.sample] - 1) - p.lo  # the last token predicts nothing
                if keep > 0:
                    out[p.sample][p.lo + 1 : p.lo + 1 + keep] = v[:keep]
        return [out[i] for i in step.local_ids]


def expected_pieces(plan: StepPlan, src: int, lengths: Sequence[int], owner: Sequence[int], dst: int) -> list[Piece]:
    """The pieces rank ``src`` sends rank ``dst``, in ``src``'s order: its micro-batches in
    work order, samples in micro-batch order, only rollouts ``dst`` holds."""
    out = []
    for mb, ranks in plan.work_of(src):
        out.extend(p for p in shard_pieces(mb, ranks.index(src), lengths) if owner[p.sample] == dst)
    return out
