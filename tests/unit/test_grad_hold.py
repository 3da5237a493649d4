"""Holding a shard block's gradients whole between micro-batches (`cost.grad_hold`): what the
recipe counts for it, when it is chosen, and that the planner's fixed bytes include it."""

from __future__ import annotations

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.base import state_recipe, unsharded_grad_bytes
from dcparallel.cost.grad_hold import hold_unsharded_grads
from dcparallel.scenarios import MODEL_PRESETS
from dcparallel.spec import GiB, h200_cluster

LLAMA_8B = MODEL_PRESETS["llama-8b"]
SIZES = [1024, 4096, 16384]


def test_the_recipe_counts_whole_fp32_gradients_during_the_micro_batches_only():
    p = LLAMA_8B.num_params
    plain, held = state_recipe(LLAMA_8B, 8, 2), state_recipe(LLAMA_8B, 8, 2, unsharded_grads=True)
    assert unsharded_grad_bytes(LLAMA_8B) == 4 * p
    assert held.held == 4 * p and plain.held == 0
    assert held.states == plain.states + 4 * p  # every micro-batch finds them
    assert held.step_peak == plain.step_peak  # reduce-scattered and freed before the step
    assert state_recipe(LLAMA_8B, 8, 1, unsharded_grads=True).held == 0  # replicated: its buffer is whole already


def test_held_only_when_the_largest_sample_still_fits_and_the_planner_counts_them():
    roomy = h200_cluster(8, shard_size=2)
    cost = AnalyticCost(LLAMA_8B, roomy)
    before = cost.terms((SIZES[-1],), 8).fixed_bytes  # cached: add_state_bytes must not leave it stale
    hold, why = hold_unsharded_grads(cost, LLAMA_8B, roomy, SIZES)
    assert hold and "fit the memory budget" in why and "one reduce-scatter per step" in why
    cost.add_state_bytes(unsharded_grad_bytes(LLAMA_8B))
    assert cost.terms((SIZES[-1],), 8).fixed_bytes == before + 4 * LLAMA_8B.num_params
    # 8B at W = 8, s = 2: about 5 bytes a parameter of states (40 GB); 32 GB more do not fit 48 GiB
    tight = h200_cluster(8, shard_size=2, memory_bytes=48 * GiB)
    hold, why = hold_unsharded_grads(AnalyticCost(LLAMA_8B, tight), LLAMA_8B, tight, SIZES)
    assert not hold and "do not fit" in why and "every micro-batch" in why
    assert AnalyticCost(LLAMA_8B, tight).model_state_bytes() < 48 * GiB  # sharded, it still plans
    assert not hold_unsharded_grads(AnalyticCost(LLAMA_8B, h200_cluster(8)), LLAMA_8B, h200_cluster(8), SIZES)[0]
