"""Profiling on two gloo ranks whose default group times out after 3 s (as a training group's
NCCL watchdog would): a rank far slower than that timeout holds up no training collective
(every wait is on the control groups), and an out-of-memory or an error on one rank of an
SP-2 group stops that layout on both ranks at once, mid-run or after it, instead of leaving
the other rank inside an all-to-all."""

from __future__ import annotations

import pytest

from tests.dist import profile_control_cases as cases
from tests.dist.harness import Workers

pytestmark = pytest.mark.dist

#: the default (training) group's collective timeout in these workers: the SP-2 runs' own
#: collectives start together (`control.run_together`) and last milliseconds
GROUP_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(2, tmp_path_factory.mktemp("ctl"), timeout_s=GROUP_TIMEOUT_S)
    yield w
    w.close()


def test_a_rank_slower_than_the_group_timeout_is_waited_for(workers):
    """Rank 1 starts its SP-1 layout 2 x the default group's timeout late; rank 0 waits for it
    at its SP-2 layout under the control timeout (120 s), not inside an all-to-all of the
    default group, which would time out there (rank 0's own SP-1 layout takes well under
    the other half)."""
    p0, p1 = workers.run(cases.case_slow_rank, 2.0 * GROUP_TIMEOUT_S)
    assert p0 == p1
    got = {(e["bucket"], e["sp"]): e for e in p0["entries"]}
    assert set(got) == {("t16", 1), ("t32", 1), ("t16", 2), ("t32", 2)}
    assert all(e["feasible"] for e in got.values())


def _chains(p: dict) -> dict:
    return {(e["bucket"], e["sp"], e["recompute"], e["mbs"]): e for e in p["entries"]}


@pytest.mark.parametrize(("depth", "where"), [(2, "forward"), (2, "backward"), (1, "end")])
def test_an_out_of_memory_on_one_rank_stops_the_layout_on_both(workers, depth, where):
    """Rank 1 runs out of memory in the SP-2 run of ``depth`` layers (t32, no recompute):
    both ranks record that layout as out of memory, try no larger micro-batch of it, and
    go on to the other layouts, ending with the same profile."""
    p0, p1 = workers.run(cases.case_fail, depth, where)
    assert p0 == p1
    got = _chains(p0)
    hit = got[("t32", 2, "none", 1)]
    assert not hit["feasible"] and hit["reason"] == "oom"
    assert hit["error"] == f"injected at depth {depth} ({where}) on rank 1"
    assert ("t32", 2, "none", 2) not in got  # the chain stopped
    for key in (("t32", 2, "full", 1), ("t16", 2, "none", 1), ("t32", 1, "none", 1)):
        assert got[key]["feasible"], key  # the other layouts were measured as usual
    assert p0["unfit_buckets"] == []


def test_an_error_on_one_rank_stops_both_with_it(workers):
    """A ValueError on rank 1 mid-forward of an SP-2 run: rank 1 raises it, rank 0 a
    RuntimeError naming rank 1 and the error, both at once (no collective timeout)."""
    with pytest.raises(AssertionError) as info:
        workers.run(cases.case_fail, 2, "forward", True)
    text = str(info.value)
    rank0, rank1 = text.split("--- rank 1 ---")
    assert (
        "RuntimeError: rank 1 of SP group [0, 1] failed while profiling (ValueError: injected at depth 2 "
        "(forward) on rank 1)" in rank0
    )
    assert "ValueError: injected at depth 2 (forward) on rank 1" in rank1
    assert "imed out" not in text and "imeout" not in text
