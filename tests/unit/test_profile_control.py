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
