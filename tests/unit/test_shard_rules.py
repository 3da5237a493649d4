"""The shard-block rules of parameter sharding (shard_size > 1), checked without processes:
which shard sizes a cluster accepts and which plans split a block."""

from __future__ import annotations

import pytest

from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.runtime.sharded import check_group
from dcparallel.spec import ClusterSpec, Layout, check_shard_size


@pytest.mark.parametrize(
    "world,gpn,s",
    [(8, 8, 1), (8, 8, 2), (8, 8, 4), (8, 8, 8), (16, 8, 16), (32, 8, 16), (12, 6, 2), (12, 6, 6), (12, 6, 12)],
)
def test_shard_sizes_that_cut_the_world_into_aligned_blocks_are_accepted(world, gpn, s):
    assert ClusterSpec(world_size=world, gpus_per_node=gpn, shard_size=s).shard_size == s
    assert check_shard_size(s, world, gpn) == s


@pytest.mark.parametrize(
    "world,gpn,s", [(8, 8, 3), (8, 8, 0), (8, 8, 16), (12, 6, 3), (12, 6, 4), (24, 8, 16), (8, 8, 2.0)]
)
def test_other_shard_sizes_are_refused(world, gpn, s):
    with pytest.raises(ValueError, match="shard_size"):
        ClusterSpec(world_size=world, gpus_per_node=gpn, shard_size=s)
    with pytest.raises(ValueError, match="shard_size"):
        check_shard_size(s, world, gpn)


def _plan(*groups: tuple[int, ...]) -> StepPlan:
    gs = tuple(GroupPlan(g, (MicroBatch((i,), Layout(len(g), 1)),), 0) for i, g in enumerate(groups))
    return StepPlan(0, tuple(range(len(groups))), gs, len(groups))


@pytest.mark.parametrize(
    "groups,s,ok",
    [
        (((0, 1), (2, 3)), 2, True),
        (((0, 1, 2, 3),), 2, True),
        (((0, 1, 2, 3),), 4, True),
        (((0,), (1,), (2, 3)), 2, False),  # SP 1 < shard size
        (((0, 1), (2, 3)), 4, False),  # SP 2 < shard size 4
        (((0,), (1, 2), (3,)), 2, False),  # (1, 2) straddles two blocks
        (((0,), (1,), (2,), (3,)), 1, True),  # no sharding: any plan
    ],
)
def test_plans_splitting_a_shard_block_are_refused(groups, s, ok):
    plan = _plan(*groups)
    if ok:
        plan.check_shard_blocks(s)
        for g in groups:
            check_group(g, s)
    else:
        with pytest.raises(ValueError, match="splits a parameter-shard block"):
            plan.check_shard_blocks(s)
        with pytest.raises(ValueError, match="splits a parameter-shard block"):
            for g in groups:
                check_group(g, s)


def test_unsharded_clip_grad_norm_clips_the_flat_gradients_the_optimizer_reads():
    import torch

    from dcparallel.runtime.engine import Engine
    from tests.support import NUM_HEADS, make_data, make_model, random_plan, reference, rel_err, run_rank_step

    data = make_data("llama", 4, 3)
    ref_loss, ref_grads = reference(make_model("llama"), data, list(range(4)))
    ref_norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in ref_grads.values())))
    model = make_model("llama")
    dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS)
    run_rank_step(dc, data, random_plan(data, list(range(4)), 1, 3), 0)
    norm = dc.clip_grad_norm_(ref_norm / 4)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm
    grads = dc.full_gradients()
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g / 4) <= 1e-5, name
    assert rel_err(dc.flat_grad[: dc.numel], torch.cat([g.reshape(-1) for g in ref_grads.values()]) / 4) <= 1e-5
