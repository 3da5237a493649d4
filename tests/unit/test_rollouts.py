"""Rollouts routed to the ranks that run them (`data.rollouts`), without a process group:
the all-to-all is played in-process from the same routes, packed buffers and plans
(`RolloutPlanner.plan_step`, the real policies) the ranks use."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.data.rollouts import (
    nbytes,
    num_targets,
    owners,
    pack,
    read_rollouts,
    rollout_batch,
    rollout_sizes,
    routes,
    unpack,
)
from dcparallel.runtime.rollout_step import RolloutPlanner, agree_schema
from dcparallel.spec import ClusterSpec, llama_like

SPEC = llama_like("tiny-llama", num_layers=3, hidden=32, num_heads=4, ffn_hidden=48, vocab_size=64)


def _rollout(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, generator=g) < 0.7
    return {
        "input_ids": torch.randint(0, 64, (n,), generator=g),
        "loss_mask": mask,
        "adv": torch.randn(n, generator=g),
        "pair": torch.randn(n, 2, generator=g).to(torch.bfloat16),
    }


def _play_step(holdings: list[list[int]], world: int, policy: str) -> tuple[dict, dict]:
    """Plans one step over the ranks' rollouts and plays its all-to-all: returns every
    rank's batches and the rollouts by global id."""
    cluster = ClusterSpec(
        world_size=world,
        gpus_per_node=world,
        memory_bytes=1_200_000,
        intra_bw=300e9,
        inter_bw=300e9,
        intra_latency=1e-5,
    )
    planner = RolloutPlanner(AnalyticCost(SPEC, cluster), cluster, policy)
    held = [[_rollout(n, 1000 * r + j) for j, n in enumerate(lens)] for r, lens in enumerate(holdings)]
    everyone = [read_rollouts(h) for h in held]
    schema = agree_schema(everyone)
    counts = [len(h) for h in held]
    lengths = [n for h in everyone for n in h.lengths]
    by_id = {i: s for i, s in enumerate(x for h in held for x in h)}
    plan, _ = planner.plan_step(lengths, 0)
    sends = routes(plan, owners(counts), world)
    batches = {}
    for dst in range(world):
        got = {}
        for src in range(world):
            buf = pack(by_id, sends[src][dst], schema)
            assert buf.numel() == nbytes(sends[src][dst], lengths, schema)
            got.update(unpack(buf, sends[src][dst], lengths, schema))
        batches[dst] = [rollout_batch(mb, ranks, dst, got) for mb, ranks in plan.work_of(dst)]
    return batches, by_id


@settings(max_examples=25, deadline=None)
@given(
    world=st.sampled_from([2, 4]),
    policy=st.sampled_from(["dcp", "bucket", "packed"]),
    holdings=st.lists(
        st.lists(st.one_of(st.integers(2, 200), st.integers(480, 580)), max_size=6), min_size=4, max_size=4
    ),
)
def test_every_rollout_is_trained_exactly_once_whatever_the_holdings(world, policy, holdings):
    holdings = holdings[:world]
    if not any(holdings):
        holdings[0] = [7]
    batches, by_id = _play_step(holdings, world, policy)
    trained = {i: 0 for i in by_id}
    seen: dict[int, set[int]] = {i: set() for i in by_id}
    for rank, bs in batches.items():
        for b in bs:
            for k, i in enumerate(b.sample_ids):
                seen[i].add(rank)
                mine = b.token_sample[0] == k
                trained[i] += int(b.loss_mask[0][mine].sum())
                # the per-token values ride with the tokens: at each trained position, the next token's
                n = by_id[i]["input_ids"].numel()
                cols = torch.nonzero(mine).reshape(-1)
                pos = b.positions[0][cols]
                assert torch.equal(b.inputs[0][cols], by_id[i]["input_ids"][pos])
                nxt = (pos + 1).clamp(max=n - 1)
                want = torch.where(pos + 1 < n, by_id[i]["adv"][nxt], torch.zeros(()))
                assert torch.equal(b.per_token["adv"][0][cols], want)
    assert trained == {i: num_targets(s) for i, s in by_id.items()}
    assert all(len(r) in (1, 2, 4) for r in seen.values())


def test_a_rollout_without_per_token_shape_is_refused():
    with pytest.raises(ValueError, match="'adv' must be a per-token tensor of 5 entries"):
        read_rollouts([{"input_ids": torch.arange(5), "adv": torch.tensor(1.0).reshape(1)}])
    with pytest.raises(ValueError, match="same per-token tensors"):
        read_rollouts([_rollout(5, 0), {"input_ids": torch.arange(4)}])
    with pytest.raises(ValueError, match="'loss_mask' must be a 1-D bool tensor"):
        read_rollouts([{"input_ids": torch.arange(4), "loss_mask": torch.ones(4)}])


def test_ranks_that_disagree_on_fields_are_named():
    a = read_rollouts([_rollout(5, 0)])
    b = read_rollouts([{"input_ids": torch.arange(4)}])
    with pytest.raises(ValueError, match=r"ranks \[1\] give rollouts with fields"):
        agree_schema([a, b, read_rollouts([])])
    with pytest.raises(ValueError, match="no rank holds a rollout"):
        agree_schema([read_rollouts([]), read_rollouts([])])


def test_rollout_sizes_end_at_the_longest():
    assert rollout_sizes(600) == (64, 128, 256, 512, 600)
    with pytest.raises(ValueError, match="max_tokens"):
        rollout_sizes(1)


def test_forward_only_costs_keep_no_activations_and_pack_bigger_micro_batches():
    from dcparallel.cost.batch import Batches
    from dcparallel.cost.forward import ForwardOnlyCost
    from dcparallel.plan.context import PlanContext
    from dcparallel.spec import Recompute, Workload

    cluster = ClusterSpec(
        world_size=2, gpus_per_node=2, memory_bytes=1_200_000, intra_bw=300e9, inter_bw=300e9, intra_latency=1e-5
    )
    base = AnalyticCost(SPEC, cluster)
    fwd = ForwardOnlyCost(base)
    full = Recompute(SPEC.num_layers, SPEC.num_layers)
    for sizes in [(100,), (100, 40, 7), (550,)]:
        for sp in (1, 2):
            t, f = base.terms(sizes, sp), fwd.terms(sizes, sp)
            # no recompute setting changes a forward pass; it costs less memory than any training one
            assert f.memory(Recompute.none()) == f.memory(full) < t.memory(full) < t.memory(Recompute.none())
            assert f.time(full) == f.time(Recompute.none()) < t.time(Recompute.none()) / 2
            grid = fwd.terms_grid(Batches.of(SPEC, [sizes]), [sp])
            assert grid.time_none[0, 0] == pytest.approx(f.time_none, rel=1e-12)
            assert grid.fixed_bytes[0, 0] == pytest.approx(f.fixed_bytes, rel=1e-12)
    assert fwd.grad_sync_time() == 0.0
    work = Workload(SPEC, (100,) * 12)
    train, forward = PlanContext(work, base, cluster), PlanContext(work, fwd, cluster)
    for sp in (1, 2):
        assert forward.max_mbs(100, sp, "fit") > train.max_mbs(100, sp, "fit")


def test_a_longest_rollout_that_fits_no_layout_is_refused_before_any_step():
    cluster = ClusterSpec(
        world_size=2, gpus_per_node=2, memory_bytes=1_200_000, intra_bw=300e9, inter_bw=300e9, intra_latency=1e-5
    )
    cost = AnalyticCost(SPEC, cluster)
    RolloutPlanner(cost, cluster, "dcp", max_tokens=600)
    with pytest.raises(ValueError, match="max_tokens=5000: sample 0 .* fits no layout"):
        RolloutPlanner(cost, cluster, "dcp", max_tokens=5000)
