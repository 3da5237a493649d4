"""The profiler on two gloo ranks: SP=2 layouts run on the real group (Ulysses all-to-alls),
the two SP=1 groups profile different buckets at the same time, every rank ends with the same
profile, the cache is shared, and a fake memory limit is handled by both ranks of a group
alike (no hang) with SP=2 fitting what SP=1 cannot."""

from __future__ import annotations

import pytest

from tests.dist import profile_cases
from tests.dist.harness import Workers

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prof2")
    w = Workers(2, tmp)
    try:
        yield w, tmp
    finally:
        w.close()


@pytest.fixture(scope="module")
def out(workers):
    w, tmp = workers
    return w.run(profile_cases.case_profile, str(tmp / "profile.json"))


def test_both_ranks_keep_the_budget_and_agree_on_each_chain(workers):
    budget = 6.0
    out = workers[0].run(profile_cases.case_budget, budget)
    assert out[0]["profile"] == out[1]["profile"]
    for o in out:
        assert o["clock"] <= budget  # no layout started whose estimate passed it
        assert o["stats"]["chains_coarse"] > 0 and o["stats"]["chains_skipped"] > 0
    entries = out[0]["profile"]["entries"]
    for sp in (1, 2):  # what a cost model needs at all: recompute none and full at every degree
        assert {e["recompute"] for e in entries if e["sp"] == sp and e["feasible"]} >= {"none", "full"}, sp


def test_every_rank_holds_the_same_whole_profile(out):
    assert out[0]["profile"] == out[1]["profile"]
    p = out[0]["profile"]
    assert p["world_size"] == 2 and p["fingerprint"]["world_size"] == 2 and p["fingerprint"]["sp_sizes"] == [1, 2]
    assert p["grad_sync_s"] > 0  # the gradient all-reduce was measured over the world
    for b in ("t16", "t40", "t64"):
        for sp in (1, 2):
            for mode in ("none", "full"):
                assert any(
                    e["bucket"] == b and e["sp"] == sp and e["recompute"] == mode and e["feasible"]
                    for e in p["entries"]
                ), (b, sp, mode)
    assert all(o["reused"] and o["reused_same"] for o in out)  # the second call reused the file on both ranks


def test_sp1_groups_split_the_buckets_and_sp2_runs_on_both_ranks(out):
    p = out[0]["profile"]
    ranks = {(e["bucket"], e["sp"]): e["ranks"] for e in p["entries"]}
    # buckets dealt round-robin to the SP=1 groups (0) and (1): measured concurrently
    assert ranks[("t16", 1)] == [0] and ranks[("t40", 1)] == [1] and ranks[("t64", 1)] == [0]
    assert all(ranks[(b, 2)] == [0, 1] for b in ("t16", "t40", "t64"))


def test_sp2_shards_the_activations(out):
    """With the sequence split over two ranks, each rank saves about half the activations:
    the SP group really ran (a rank running the whole sequence would save as much as SP=1)."""
    p = out[0]["profile"]
    mem = {(e["bucket"], e["sp"], e["recompute"], e["mbs"]): e["memory_bytes"] for e in p["entries"]}
    for b in ("t40", "t64"):
        ratio = mem[(b, 2, "none", 1)] / mem[(b, 1, "none", 1)]
        assert 0.4 < ratio < 0.75, (b, ratio)
    # validation ran at full depth for SP=2 too; the memory estimate extrapolates exactly
    v = out[0]["stats"]["validation"]
    assert {row["sp"] for row in v} == {1, 2} and max(row["memory_error"] for row in v) == 0.0


def test_fake_limit_oom_in_an_sp_group_is_survived_and_sp2_fits_what_sp1_cannot(out):
    lim = out[0]["limited"]
    assert lim == out[1]["limited"]
    got = {(e["bucket"], e["sp"], e["recompute"], e["mbs"]): e for e in lim["entries"]}
    assert not got[("t64", 1, "none", 1)]["feasible"]
    assert got[("t64", 2, "none", 1)]["feasible"]
    assert got[("t64", 2, "none", 1)]["memory_bytes"] + lim["model_state_bytes"] <= out[0]["limit"]
    reasons = {e.get("reason") for e in lim["entries"] if not e["feasible"]}
    assert "oom" in reasons  # at least one short stack really raised torch.OutOfMemoryError
    assert lim["unfit_buckets"] == []


def test_the_launchs_links_are_timed_alike_on_both_ranks_and_cached(workers):
    w, tmp = workers
    out = w.run(profile_cases.case_cpu_links, str(tmp / "cpu-calibration.json"))
    timed = out[0]["timed"]
    assert out[1]["timed"] == timed and all(o["again"] == timed for o in out)
    # gloo on one machine: slower than the GPU link it replaces
    assert 0 < timed["intra_bw"] < 1e10 and timed["intra_bw"] == timed["inter_bw"]
    assert timed["intra_latency"] >= 0 and timed["intra_latency"] == timed["inter_latency"]
