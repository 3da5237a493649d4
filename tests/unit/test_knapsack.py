"""PAC's knapsack (`MicroBatchTerms.cheapest_recompute`) against brute-force enumeration."""

import random

from dcparallel.cost.base import MicroBatchTerms
from dcparallel.spec import Recompute


def _random_terms(rng: random.Random) -> MicroBatchTerms:
    L = rng.randint(1, 12)
    save_full = rng.uniform(1, 10)
    save_attn = 0.0 if rng.random() < 0.2 else rng.uniform(0, save_full)
    save_mlp = rng.uniform(0, save_full - save_attn + rng.uniform(0, 2))
    dt_attn, dt_mlp = rng.uniform(0, 2), rng.uniform(0, 2)
    tr_none = rng.uniform(0, 5)
    return MicroBatchTerms(
        num_layers=L, time_none=1.0, dt_attn=dt_attn, dt_mlp=dt_mlp, dt_full=dt_attn + dt_mlp,
        fixed_bytes=rng.uniform(0, 50), act_layer=save_full + rng.uniform(0, 3),
        save_attn=save_attn, save_mlp=save_mlp, save_full=save_full,
        # recomputation materializes a layer again in backward: its transient is never smaller
        transient_none=tr_none, transient_rec=tr_none + rng.uniform(0, 5))


def test_knapsack_matches_enumeration():
    rng = random.Random(1)
    for _ in range(3000):
        t = _random_terms(rng)
        budget = rng.uniform(0, 200)
        L = t.num_layers
        feasible = [Recompute(a, m) for a in range(L + 1) for m in range(L + 1)
                    if t.memory(Recompute(a, m)) <= budget]
        got = t.cheapest_recompute(budget)
        if not feasible:
            assert got is None
            continue
        best = min(t.time(r) for r in feasible)
        assert got is not None
        assert t.memory(got) <= budget
        assert abs(t.time(got) - best) < 1e-9


def test_knapsack_prefers_keeping_everything_when_it_fits():
    t = _random_terms(random.Random(3))
    assert t.cheapest_recompute(t.memory(Recompute(0, 0))) == Recompute(0, 0)
    assert t.cheapest_recompute(t.memory(Recompute(t.num_layers, t.num_layers)) - 1) is None
