"""The ranks' agreement checks on one process: `comm.check_agree` (what `prepare` runs) with
the other ranks' answers stood in, and the loader's `check_plans` setting."""

from __future__ import annotations

import pytest

from dcparallel.data.plan_check import check_every
from dcparallel.runtime import comm


def _as_if_ranks(monkeypatch, others: list[dict]) -> None:
    """`comm.all_gather_object` answers with this rank's object, then ``others``' (ranks 1..):
    each of them this rank's fields with the given ones replaced."""

    def gather(obj, group=comm.WORLD):
        return [obj] + [{**obj, **{k: (comm.digest(v), repr(v)[:160]) for k, v in o.items()}} for o in others]

    monkeypatch.setattr(comm, "all_gather_object", gather)


def test_the_first_field_that_differs_is_named_with_its_ranks_values_and_fix(monkeypatch):
    profile = {"entries": [[1, 2, 0.5]]}
    fields = {
        "memory budget": (2**30, "pass the same memory_bytes"),
        "cost model": (profile, "delete the cached profile files on every node"),
    }
    _as_if_ranks(monkeypatch, [{}, {"cost model": {"entries": [[1, 2, 0.7]]}}, {}])
    with pytest.raises(ValueError) as e:
        comm.check_agree(fields, "prepare")
    assert str(e.value) == (
        "prepare: cost model differs across ranks (ranks [0, 1, 3]: {'entries': [[1, 2, 0.5]]}; "
        "ranks [2]: {'entries': [[1, 2, 0.7]]}); every rank must plan from the same cost model: "
        "delete the cached profile files on every node"
    )
    _as_if_ranks(monkeypatch, [{}, {}])
    comm.check_agree(fields, "prepare")  # the same everywhere: nothing raised


def test_many_ranks_are_shortened_in_the_message(monkeypatch):
    _as_if_ranks(monkeypatch, [{}] * 20 + [{"x": 2}])
    with pytest.raises(ValueError, match=r"ranks \[0, 1, \.\.\. 20\] \(21 ranks\): 1; ranks \[21\]: 2"):
        comm.check_agree({"x": (1, "fix")}, "prepare")


def test_check_plans_is_a_number_of_steps():
    assert check_every(True) == 1 and check_every(False) == 0 and check_every(50) == 50
    with pytest.raises(ValueError, match=r"check_plans=-1: .* an int >= 0"):
        check_every(-1)
    with pytest.raises(ValueError, match=r"check_plans=0.5"):
        check_every(0.5)


def test_prepare_checks_the_cost_models_content_across_ranks(monkeypatch):
    """`prepare` compares the cost model itself (a profile's entries, not its fingerprint): a
    rank whose cost model differs stops every rank before the loader is built."""
    import dcparallel
    from dcparallel.data.synthetic import SyntheticText
    from tests.support import make_model

    lengths = [24, 40, 64, 100] * 4
    dc = dcparallel.DataCentricParallel(make_model("llama"), memory_bytes=2**30)
    _as_if_ranks(monkeypatch, [{"cost model": "another profile"}])
    with pytest.raises(
        ValueError,
        match=r"prepare: cost model differs across ranks \(ranks \[0\]: .*; ranks \[1\]: "
        r"'another profile'\); .* delete the cached profile files on every node",
    ):
        dc.prepare(SyntheticText(lengths, vocab=64), lengths=lengths, tokens_per_step=200, cost="analytic")
    assert dc.loader is None
