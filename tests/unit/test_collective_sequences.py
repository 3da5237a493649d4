"""Every group's ranks issue the same collectives, for real plans at 64 and 1024 ranks.

One process replays, rank by rank, what the runtime issues in one planned step, through the
runtime's own comm layer with `torch.distributed` swapped for a recorder: per micro-batch of
`StepPlan.work_of(rank)`, one Ulysses attention (`comm.seq_to_heads` / `comm.heads_to_seq`
forward and, through autograd, backward) on this rank's shard of the micro-batch's padded
length (`data.collate.padded_length`: what the collate hands the rank), with the shard
block's per-micro-batch FSDP collectives where parameters are sharded; then the step's
gradient sync and optimizer collectives on the world. Layers repeat the same attention, so
one stands for all. Asserted: for every group, all its members recorded the same sequence
(kind, group ranks, shape, dtype), and the step's collectives all complete when each runs
only once every member of its group has reached it (no cross-group wait cycle).
"""

from __future__ import annotations

import functools
import types

import pytest
import torch

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.heads import kv_repeats
from dcparallel.data.collate import padded_length
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.runtime import comm
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import ClusterSpec, Workload, llama_like, stdit_like

HEADS, KV_HEADS = 32, 8
TEXT = llama_like("lm-32h", num_layers=4, hidden=1024, num_heads=HEADS, ffn_hidden=2816, vocab_size=32000)
VIDEO = stdit_like("dit-32h", num_pairs=2, hidden=1024, num_heads=HEADS, context_tokens=64)


class _Group(types.SimpleNamespace):
    """A recorded process group: its ranks and this rank's index in them."""


class Recorder:
    """Stands in for `torch.distributed` inside `runtime.comm`: records each collective as
    (kind, group ranks, shape, dtype) and leaves the output shaped as the real one."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self):
        self.log: list[tuple] = []

    def get_world_size(self, group=None):
        return len(group.ranks)

    def get_rank(self, group=None):
        return group.slot

    def all_to_all_single(self, out, x, group=None):
        self.log.append(("all_to_all_single", group.ranks, tuple(x.shape), x.dtype))
        out.copy_(x)


def _record_rank(plan, rank: int, spec, world: int, shard_size: int) -> list[tuple]:
    log: list[tuple] = []
    for mb, ranks in plan.work_of(rank):
        ranks = tuple(ranks)
        if shard_size > 1:  # FSDP2 unshards each layer in forward, reduce-scatters in backward
            start = rank // shard_size * shard_size
            block = tuple(range(start, start + shard_size))
            log.append(("fsdp_all_gather", block, (spec.num_layers,), torch.bfloat16))
        rows, length = _shard_shape(spec, mb)
        sp = len(ranks)
        mine = _attention(rows, padded_length(length, sp) // sp, sp)
        log.extend((kind, ranks, shape, dtype) for kind, shape, dtype in mine)
        if shard_size > 1:
            log.append(("fsdp_reduce_scatter", block, (spec.num_layers,), torch.float32))
    everyone = tuple(range(world))
    log.append(("all_reduce", everyone, ("gradient buckets",), torch.float32))  # GradSync, every rank
    log.append(("all_gather", everyone, ("parameter shards",), torch.bfloat16))  # ZeRO-1 step
    return log


def _shard_shape(spec, mb) -> tuple[int, int]:
    """(rows, tokens per row) of a micro-batch, as the collate builds it: text packs its
    documents into one row; video stacks its samples (one shape) as rows."""
    tokens = [spec.tokens(_SIZES[i]) for i in mb.sample_ids]
    return (1, sum(tokens)) if spec.kind == "text" else (len(tokens), tokens[0])


@functools.cache
def _attention(rows: int, local: int, sp: int) -> tuple[tuple, ...]:
    """One Ulysses attention's collectives (`runtime.ulysses`) on a group of ``sp`` ranks, as
    (kind, shape, dtype): q, k, v to heads, the output back to sequence, and the backward of
    both, recorded through `runtime.comm` on meta tensors (cached: their shapes depend on the
    shard's shape and the group's size, not on which member runs them)."""
    if sp == 1:
        return ()
    rec = Recorder()
    group = _Group(ranks=tuple(range(sp)), slot=0)
    comm_dist, comm_is_distributed = comm.dist, comm.is_distributed
    comm.dist, comm.is_distributed = rec, lambda: True
    try:
        with torch.device("meta"):  # shapes only, nothing computed (nor allocated)
            _ulysses(rows, local, group)
    finally:
        comm.dist, comm.is_distributed = comm_dist, comm_is_distributed
    return tuple((kind, shape, dtype) for kind, _, shape, dtype in rec.log)


def _ulysses(rows: int, local: int, group) -> None:
    q = torch.zeros(rows, local, HEADS, 1, dtype=torch.bfloat16, requires_grad=True)
    # past the key/value heads each is repeated first, as `runtime.ulysses` does
    kv_heads = KV_HEADS * kv_repeats(KV_HEADS, len(group.ranks))
    kv = torch.zeros(rows, local, kv_heads, 1, dtype=torch.bfloat16, requires_grad=True)
    qh, kh, vh = comm.seq_to_heads([q, kv, kv], group)
    out = comm.heads_to_seq(qh + kh.sum(2, keepdim=True) + vh.sum(2, keepdim=True), group)
    out.sum().backward()


_SIZES: list = []


def _plan(spec, sizes, world: int, shard_size: int, policy: str = "dcp"):
    """The planner's plan of the first step of an epoch of ``sizes``, as the loader makes it."""
    _SIZES[:] = sizes
    cl = ClusterSpec(
        world_size=world,
        gpus_per_node=8,
        memory_bytes=80 * 2**30,
        intra_bw=300e9,
        intra_latency=1e-5,
        inter_bw=40e9,
        inter_latency=2e-5,
        shard_size=shard_size,
    )
    w = Workload(spec, tuple(sizes))
    ctx = PlanContext(w, AnalyticCost(spec, cl), cl)
    steps = form_steps(w.tokens, seed=0, tokens_per_step=sum(w.tokens) // 2)
    plan = make_planner(policy, ctx, steps, score=step_seconds(ctx)).plan(steps[0])
    plan.check_shard_blocks(shard_size)
    return plan


def _check_groups_agree(logs: dict[int, list[tuple]]) -> int:
    """Every group's members recorded the same sequence on it; returns the groups seen."""
    by_group: dict[tuple, dict[int, list]] = {}
    for rank, log in logs.items():
        for rec in log:
            by_group.setdefault(rec[1], {}).setdefault(rank, []).append(rec)
    for ranks, seqs in by_group.items():
        assert sorted(seqs) == list(ranks), f"group {ranks[:8]}: only ranks {sorted(seqs)[:8]} issue on it"
        first = seqs[ranks[0]]
        for r in ranks[1:]:
            assert seqs[r] == first, f"group {ranks[:8]}...: rank {r} issues {seqs[r][:3]}, rank {ranks[0]} {first[:3]}"
    return len(by_group)


def _check_completes(logs: dict[int, list[tuple]]) -> None:
    """Runs the collectives as NCCL would: one starts when every member of its group has it
    next. All of them must run (a rank left waiting is a hang)."""
    pos = dict.fromkeys(logs, 0)
    waiting: dict[tuple, set[int]] = {}
    ready = []

    def arrive(r: int) -> None:
        if pos[r] < len(logs[r]):
            rec = logs[r][pos[r]]
            waiting.setdefault(rec, set()).add(r)
            if len(waiting[rec]) == len(rec[1]):
                ready.append(rec)

    for r in logs:
        arrive(r)
    while ready:
        rec = ready.pop()
        members = waiting.pop(rec)
        assert members == set(rec[1]), (rec[:2], sorted(members)[:8])
        for m in members:
            pos[m] += 1
            arrive(m)
    stuck = {r: logs[r][pos[r]][:2] for r in logs if pos[r] < len(logs[r])}
    assert not stuck, f"ranks wait forever: {dict(list(stuck.items())[:4])}"


def _text_sizes(n: int) -> list[int]:
    return [[300, 2_000, 9_000, 40_000, 120_000, 700][i % 6] + 13 * (i % 7) for i in range(n)]


def _video_sizes(n: int) -> list[tuple[int, int, int]]:
    return [[(17, 256, 256), (51, 512, 512), (1, 256, 256), (68, 720, 1280)][i % 4] for i in range(n)]


CASES = {
    "text": (TEXT, _text_sizes, 1),
    "video": (VIDEO, _video_sizes, 1),
    "text, shard_size 8": (TEXT, _text_sizes, 8),
}


@pytest.mark.parametrize("world", [64, 1024])
@pytest.mark.parametrize("case", list(CASES))
def test_every_groups_ranks_issue_the_same_collectives(case, world):
    spec, sizes, shard_size = CASES[case]
    plan = _plan(spec, sizes(2 * world), world, shard_size)
    assert set(plan.busy_sizes()) - {1}, "the plan should use SP groups"
    logs = {r: _record_rank(plan, r, spec, world, shard_size) for r in range(world)}
    assert _check_groups_agree(logs) > 2
    _check_completes(logs)


class _Only:
    """A plan's view that hands a rank only its first ``n`` micro-batches."""

    def __init__(self, plan, n: int):
        self.plan, self.n = plan, n

    def work_of(self, rank: int):
        return self.plan.work_of(rank)[: self.n]


def test_the_recorder_catches_a_rank_that_runs_its_micro_batches_in_another_order():
    """The checks themselves: swap the first two micro-batches of a rank (two whose collectives
    differ, else the swap changes nothing) and one of them fails: on one group, its members
    disagree; across two groups, the ranks wait on each other forever."""
    plan = _plan(TEXT, _text_sizes(128), 64, 1)
    logs = {r: _record_rank(plan, r, TEXT, 64, 1) for r in range(64)}

    def swapped(r: int) -> list:
        n0 = len(_record_rank(_Only(plan, 1), r, TEXT, 64, 1)) - 2  # the first micro-batch's records
        n1 = len(_record_rank(_Only(plan, 2), r, TEXT, 64, 1)) - 2  # the first two's
        return logs[r][n0:n1] + logs[r][:n0] + logs[r][n1:]

    victim = next(r for r in range(64) if len(plan.work_of(r)) >= 2 and swapped(r) != logs[r])
    logs[victim] = swapped(victim)
    with pytest.raises(AssertionError, match="issues|wait forever"):
        _check_groups_agree(logs)
        _check_completes(logs)
