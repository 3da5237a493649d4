"""The bucketed gradient sync launched during the last backward (runtime/grad_sync.py) on
gloo, world 2 and 4: the same numbers as one unbucketed all-reduce after the last
micro-batch, whatever the number of micro-batches of each rank (idle ranks, uneven counts,
a whole-world SP group in the overlapped backward, parameters the last backward does not
reach on some ranks), and no rank left waiting.

Exactness: with 2 ranks an element's sum a + b does not depend on the order, so the
bucketed result must be bitwise the one of the single all-reduce. With 4 ranks gloo's
algorithm may add an element's 4 values in an order that depends on where the element sits
in the message, so bucketing may change fp32 rounding: 1e-6 relative per buffer (a few
eps = 6e-8) is asserted; a lost or doubled bucket changes it by 100%."""

from __future__ import annotations

import pytest

from tests.dist import grad_sync_cases as cases

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("kind", ["llama", "dit"])
def test_bucketed_overlapped_sync_equals_unbucketed(workers, kind):
    seeds = [3, 4, 5, 6, 7]
    out = workers.run(cases.case_bucketed_vs_unbucketed, kind, seeds, 4100)
    world = workers.world
    modes_idle = set()
    for rank, per_rank in enumerate(out):
        for res in per_rank:
            a, b = res["a"], res["b"]
            assert res["a_buckets"] == 1 and res["num_buckets"] > 5, res["num_buckets"]
            assert res["grads_are_views"]
            if world == 2:
                assert a.equal(b), f"{res['mode']}: max diff {(a - b).abs().max().item()}"
                assert res["loss_a"] == res["loss_b"]
            else:
                rel = ((a - b).norm() / a.norm()).item()
                assert rel <= 1e-6, (res["mode"], rel)
                assert abs(res["loss_a"] - res["loss_b"]) <= 1e-6 * abs(res["loss_a"])
            if res["num_mbs"] == 0:
                modes_idle.add(res["mode"])
                assert res["overlapped"] == 0
            elif rank != 0:
                # rank 0 never announces its last micro-batch; every other busy rank launched
                # buckets during its last backward (all but the ones the hooks never complete)
                assert res["overlapped"] > res["num_buckets"] // 2, res
            else:
                assert res["overlapped"] == 0
    assert {"idle", "uneven"} <= modes_idle  # idle ranks were exercised


def test_idle_ranks_and_uneven_counts_never_deadlock(workers):
    losses = workers.run(cases.case_idle_steps, "llama", 6, 2048)
    assert all(len(x) == 6 for x in losses)
    assert all(x == losses[0] for x in losses)  # one sync: every rank holds the step's loss
    assert losses[0][-1] < losses[0][0]


def test_unreached_parameters_do_not_hold_back_later_buckets(workers):
    """An expert no token reached in a rank's last micro-batch has no hook in its backward; it
    must not keep its bucket and every later one waiting for sync_gradients. Every busy rank
    launches all its buckets during the last backward, whether the experts are reached on no
    rank, on one rank and not another, or only in earlier micro-batches, and the numbers are
    those of the unbucketed sync (bitwise at world 2: a + b = b + a)."""
    out = workers.run(cases.case_unreached_experts, [11, 12, 13, 14], 4100)  # each mode of REACH once
    for per_rank in out:
        for res in per_rank:
            a, b = res["a"], res["b"]
            if workers.world == 2:
                assert a.equal(b), f"{res['mode']}: max diff {(a - b).abs().max().item()}"
                assert res["loss_a"] == res["loss_b"]
            else:
                assert ((a - b).norm() / a.norm()).item() <= 1e-6, res["mode"]
            assert res["num_buckets"] > 5
            expected = res["num_buckets"] if res["num_mbs"] else 0
            assert res["overlapped"] == expected, (res["mode"], res["num_mbs"], res["overlapped"], expected)
    assert any(res["num_mbs"] for per_rank in out for res in per_rank if res["mode"] == "split")
    # "earlier" reaches the experts before the last micro-batch: some rank ran more than one
    assert any(res["num_mbs"] > 1 for per_rank in out for res in per_rank if res["mode"] == "earlier")


def test_zero1_sync_reduces_each_bucket_to_its_shard_owner(workers):
    """With the ZeRO-1 optimizer each rank reads only its shard, so the sync sums each bucket
    into the rank whose shard holds it: no gradient all-reduce (only the two statistics
    slots), every bucket inside one shard, launched in the buffer's order from its end (most
    of them during the last backward), and each rank receives exactly its shard's elements
    (4 S bytes, not the whole buffer's 4 W S). That shard equals the replicated all-reduce's
    (bitwise at world 2), whole gradients gathered from the shards equal it everywhere, p.grad
    stays None and gradients() refuses, and clipping on shards gives the replicated norm."""
    world = workers.world
    out = workers.run(cases.case_zero1_sync, [3, 4, 5, 6, 7], 4100, 0.05)
    for rank, per_rank in enumerate(out):
        for res in per_rank:
            s, calls = res["shard_numel"], res["calls"]
            assert [c for c in calls if c[0] != "reduce"] == [("all_reduce", world * s, 2, None)], calls[:3]
            reduces = [c for c in calls if c[0] == "reduce"]
            assert len(reduces) == res["num_buckets"] - 1 > 5
            assert all(dst * s <= off and off + n <= (dst + 1) * s for _, off, n, dst in reduces)  # one owner each
            assert [off for _, off, _, _ in reduces] == sorted((off for _, off, _, _ in reduces), reverse=True)
            received = {r: sum(n for _, _, n, dst in reduces if dst == r) for r in range(world)}
            assert received == dict.fromkeys(range(world), s)  # each rank: its shard, once
            if res["num_mbs"]:
                assert res["overlapped"] > res["num_buckets"] // 2, res["overlapped"]
            mine = slice(rank * s, min((rank + 1) * s, res["numel"]))
            a, b = res["a"][mine], res["b"][mine]
            ca, cb = res["clipped_a"][mine], res["clipped_b"][mine]
            assert res["grads_none"] and res["gradients_refused"]
            assert res["norm_a"] > 0.05 and abs(res["norm_a"] - res["norm_b"]) <= 1e-6 * res["norm_a"]
            if world == 2:
                assert a.equal(b) and res["loss_a"] == res["loss_b"], (a - b).abs().max().item()
                assert all(res["full_a"][n].equal(g) for n, g in res["full_b"].items())
            else:
                assert ((a - b).norm() / a.norm()).item() <= 1e-6
                assert all(
                    ((res["full_a"][n] - g).norm() / res["full_a"][n].norm()).item() <= 1e-6
                    for n, g in res["full_b"].items()
                )
            assert ((ca - cb).norm() / ca.norm()).item() <= 1e-6
