"""The step former: every policy plans the same steps."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcparallel.plan.steps import form_steps


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300), st.integers(1, 20000), st.integers(0, 3))
def test_every_sample_in_exactly_one_step(tokens, budget, seed):
    steps = form_steps(tokens, seed=seed, tokens_per_step=budget)
    ids = [i for s in steps for i in s.sample_ids]
    assert sorted(ids) == list(range(len(tokens)))
    for s in steps[:-1]:  # each full step reaches the budget; the crossing sample is the last one
        total = sum(tokens[i] for i in s.sample_ids)
        assert total >= budget
        assert total - tokens[s.sample_ids[-1]] < budget
    assert [s.index for s in steps] == list(range(len(steps)))


def test_deterministic_by_seed_and_epoch():
    tokens = list(range(1, 200))
    a = form_steps(tokens, seed=1, epoch=0, tokens_per_step=500)
    assert a == form_steps(tokens, seed=1, epoch=0, tokens_per_step=500)
    assert a != form_steps(tokens, seed=1, epoch=1, tokens_per_step=500)


def test_oversize_sample_is_a_step_by_itself():
    tokens = [10, 10, 10_000, 10]
    steps = form_steps(tokens, seed=0, tokens_per_step=100)
    big = [s for s in steps if 2 in s.sample_ids][0]
    assert big.sample_ids[-1] == 2  # it closes its step


def test_samples_per_step_and_ids_subset():
    steps = form_steps([5] * 10, seed=0, samples_per_step=3)
    assert [len(s.sample_ids) for s in steps] == [3, 3, 3, 1]
    sub = form_steps([5] * 10, seed=0, samples_per_step=3, ids=[0, 2, 4])
    assert sorted(i for s in sub for i in s.sample_ids) == [0, 2, 4]
    full_order = [i for s in steps for i in s.sample_ids if i in (0, 2, 4)]
    assert [i for s in sub for i in s.sample_ids] == full_order


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        form_steps([1], seed=0)
    with pytest.raises(ValueError, match="tokens_per_step must be > 0"):
        form_steps([1], seed=0, tokens_per_step=0)
