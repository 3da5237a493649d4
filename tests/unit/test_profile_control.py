"""`profile.control.run_together` on one rank, and the outcome a group's statuses give (the
agreements themselves run at world 2 in tests/dist/test_dist_profile_control.py)."""

from __future__ import annotations

import pytest
import torch

from dcparallel.profile.control import DONE, ERROR, OOM, RUNNING, _outcome, run_together


def test_one_rank_returns_none_or_the_out_of_memory_and_raises_other_errors():
    assert run_together(lambda: None, None, (0,)) is None

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore lines")

    assert run_together(oom, None, (0,)) == "CUDA out of memory. Tried to allocate 2 GiB"

    def bad():
        raise KeyError("x")

    with pytest.raises(KeyError):
        run_together(bad, None, (0,))


def test_the_group_outcome_is_the_first_error_then_the_first_out_of_memory():
    assert _outcome([(DONE, ""), (DONE, "")], (2, 3), None) is None
    assert _outcome([(DONE, ""), (OOM, "a"), (OOM, "b")], (0, 1, 2), None) == "a"
    with pytest.raises(RuntimeError, match=r"rank 3 of SP group \[2, 3\] failed while profiling \(ValueError: v\)"):
        _outcome([(OOM, "a"), (ERROR, "ValueError: v")], (2, 3), None)
    with pytest.raises(RuntimeError, match="ran different collectives"):  # one rank done, one still running
        _outcome([(DONE, ""), (RUNNING, "")], (0, 1), None)


def test_gloo_twins_only_for_the_groups_that_measure_a_bucket(monkeypatch):
    """At 1024 ranks with 5 buckets, `group_buckets` gives items to the first 5 aligned groups
    of each degree: only those get gloo twins (5 per degree, not 1024 / k), and every rank of
    such a group finds its twin (fake process group; `new_group` counted, not run)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dcparallel.profile.config import group_buckets
    from dcparallel.profile.control import ControlGroups
    from dcparallel.runtime import comm

    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: made.append(tuple(ranks or ())) or object())
    monkeypatch.setattr(comm, "_control", {})
    monkeypatch.setattr(ControlGroups, "_twins", {})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
    try:
        cg = ControlGroups([1, 2, 4, 8], num_buckets=5)
        twins = [r for r in made if 1 < len(r) < 1024]
        assert sorted(len(r) for r in twins) == [2] * 5 + [4] * 5 + [8] * 5
        for rank in (0, 9, 39, 1023):
            for sp, ranks, _ in group_buckets(list(range(5)), [1, 2, 4, 8], 1024, rank):
                assert sp == 1 or cg.of(ranks) is not None
    finally:
        dist.destroy_process_group()
