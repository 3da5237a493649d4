"""Steps planned from rollouts the ranks hold (`DataCentricParallel.plan_batch`), on gloo at
world 2 and 4, against a single process over the same rollouts: a GRPO loss (clipped
ratio, KL to the reference, entropy) with per-token advantages and log-probs, under three
normalizations. fp32 on CPU; sums run in another order than the single process's, so the
tolerance is 1e-5 relative per gradient tensor."""

from __future__ import annotations

import pytest

from tests.dist import rl_cases

pytestmark = pytest.mark.dist


def test_rl_step_from_uneven_holdings_matches_one_process(workers):
    # dcp's own planners: on a step this small dcp also offers a static layout of one SP degree
    # and keeps it when faster; its own plans mix SP 1 and 2, which this test must exercise
    out = workers.run(rl_cases.case_rl_step, "dcp-own")
    world = workers.world
    # every rank holds what the case dealt it (one rank with most of the long ones; at world 4 one with none)
    assert [o["held"] for o in out] == [rl_cases.holding(r, world) for r in range(world)]
    if world == 4:
        assert out[3]["held"] == []
    # one plan: each rollout in exactly one group; every rank of that group ran it
    groups = out[0]["plan_groups"]
    assert all(o["plan_groups"] == groups for o in out)
    ran = {}
    for ranks, mbs in groups:
        for ids in mbs:
            for i in ids:
                assert i not in ran, f"rollout {i} planned twice"
                ran[i] = tuple(ranks)
    assert sorted(ran) == list(range(rl_cases.NUM_ROLLOUTS))
    for r, o in enumerate(out):
        mine = sorted(i for ranks, ids, _ in o["work"] for i in ids)
        assert mine == sorted(i for i, g in ran.items() if r in g), f"rank {r} ran {mine}"
    sps = {sp for o in out for _, _, sp in o["work"]}
    assert 1 in sps and 2 in sps, f"the step should run SP=1 and SP=2 micro-batches; saw {sps}"
    assert out[0]["num_targets"] == sum(int(r["loss_mask"][1:].sum()) for r in rl_cases.make_rollouts())
    for norm in rl_cases.NORMS:
        got = out[0][norm]
        # the global normalizer: every trained token counted once although SP=2 rollouts are
        # split (per-sequence weights 1 / targets: each rollout counts 1)
        expected = rl_cases.NUM_ROLLOUTS if norm == "sequence" else out[0]["num_targets"]
        assert abs(got["count"] - expected) <= 1e-5 * expected, (norm, got["count"])
        assert abs(got["loss"] - got["ref_loss"]) <= 1e-5 * abs(got["ref_loss"]), norm
        worst = max(got["rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, f"{norm}: gradient of {worst[0]} off by {worst[1]:.2e}"


def test_forward_only_logprobs_come_back_to_their_rank_equal_to_one_process(workers):
    out = workers.run(rl_cases.case_forward_logprobs)
    for r, o in enumerate(out):
        assert o["num"] == len(rl_cases.holding(r, workers.world))
        assert o["exact_first"]
        assert max(o["rel"], default=0.0) <= 1e-6, f"rank {r}: log-probs off by {max(o['rel']):.2e}"
    # planned as a forward pass: nothing recomputed (bigger micro-batches: tests/unit/test_rollouts.py)
    assert out[0]["recompute"] == [(0, 0)], out[0]
    assert max(out[0]["sps"]) >= 2, "the long rollouts' outputs should come back from SP groups"
