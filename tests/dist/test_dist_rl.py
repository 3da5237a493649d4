"""Steps planned from rollouts the ranks hold (`DataCentricParallel.plan_batch`), on gloo at
world 2 and 4, against a single process over the same rollouts: a GRPO loss (clipped
ratio, KL to the reference, entropy) with per-token advantages and log-probs, under three
normalizations. fp32 on CPU; sums run in another order than the single process's, so the
tolerance is 1e-5 relative per gradient tensor."""

from __future__ import annotations

import pytest

from tests.dist import rl_cases

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_rl_step_from_uneven_holdings_matches_one_process(workers, norm):
    out = workers.run(rl_cases.case_rl_step, norm)
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
    # the global normalizer: every trained token counted once although SP=2 rollouts are split
    # (per-sequence weights 1 / targets: each rollout counts 1)
    assert out[0]["num_targets"] == sum(int(r["loss_mask"][1:].sum()) for r in rl_cases.make_rollouts())
    expected = rl_cases.NUM_ROLLOUTS if norm == "sequence" else out[0]["num_targets"]
    assert abs(out[0]["count"] - expected) <= 1e-5 * expected
    assert abs(out[0]["loss"] - out[0]["ref_loss"]) <= 1e-5 * abs(out[0]["ref_loss"])
    worst = max(out[0]["rel"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-5, f"{norm}: gradient of {worst[0]} off by {worst[1]:.2e}"
