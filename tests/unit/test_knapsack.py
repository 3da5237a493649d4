"""PAC's knapsack (`MicroBatchTerms.cheapest_recompute`) against brute-force enumeration."""

import math
import random

from dcparallel.cost.base import MicroBatchTerms, _first_fit
from dcparallel.spec import Recompute


def _random_terms(rng: random.Random) -> MicroBatchTerms:
    L = rng.randint(1, 12)
    save_full = rng.uniform(1, 10)
    save_attn = 0.0 if rng.random() < 0.2 else rng.uniform(0, save_full)
    save_mlp = rng.uniform(0, save_full - save_attn + rng.uniform(0, 2))
    dt_attn, dt_mlp = rng.uniform(0, 2), rng.uniform(0, 2)
    tr_none = rng.uniform(0, 5)
    return MicroBatchTerms(
        num_layers=L,
        time_none=1.0,
        dt_attn=dt_attn,
        dt_mlp=dt_mlp,
        dt_full=dt_attn + dt_mlp,
        fixed_bytes=rng.uniform(0, 50),
        act_layer=save_full + rng.uniform(0, 3),
        save_attn=save_attn,
        save_mlp=save_mlp,
        save_full=save_full,
        # recomputation materializes a layer again in backward: its transient is never smaller
        transient_none=tr_none,
        transient_rec=tr_none + rng.uniform(0, 5),
    )


def test_knapsack_matches_enumeration():
    rng = random.Random(1)
    for _ in range(3000):
        t = _random_terms(rng)
        budget = rng.uniform(0, 200)
        L = t.num_layers
        feasible = [Recompute(a, m) for a in range(L + 1) for m in range(L + 1) if t.memory(Recompute(a, m)) <= budget]
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


def test_the_scan_starts_only_past_choices_that_cannot_fit_in_the_layers():
    """`cheapest_recompute` starts its scan over f (layers recomputing both sub-blocks) at
    `_first_fit`: every f it skips has f + x > L (x: the fewest one-kind layers that save the
    rest), so the scan would have passed it by; on the model's scale (GB of activations,
    32-80 layers), where most f are skipped, and on the small random terms above."""
    rng = random.Random(7)
    skipped = 0
    for case in range(4000):
        if case % 2:
            t = _random_terms(rng)
            budget = rng.uniform(0, 200)
        else:
            L = rng.choice([32, 40, 48, 80])
            act = rng.uniform(1e8, 4e9)
            save_attn, save_mlp = act * rng.uniform(0.05, 0.5), act * rng.uniform(0.05, 0.5)
            t = MicroBatchTerms(
                num_layers=L,
                time_none=1.0,
                dt_attn=0.3,
                dt_mlp=0.5,
                dt_full=0.8,
                fixed_bytes=rng.uniform(1e9, 3e10),
                act_layer=act,
                save_attn=save_attn,
                save_mlp=save_mlp,
                save_full=min(act, save_attn + save_mlp) * rng.uniform(0.9, 1.0),
                transient_none=0.1 * act,
                transient_rec=0.2 * act,
            )
            budget = rng.uniform(t.fixed_bytes, t.fixed_bytes + L * act)
        L = t.num_layers
        need = t.fixed_bytes + L * t.act_layer + t.transient_rec - budget
        if t.memory(Recompute(0, 0)) <= budget:
            continue
        for save in (t.save_attn, t.save_mlp):
            start = _first_fit(need, t.save_full, save, L)
            assert 0 <= start <= L
            for f in range(start):
                rest = need - f * t.save_full
                assert rest > 0 and save > 0, (case, f, start)  # the scan would not have stopped here
                assert f + max(1, math.ceil(rest / save - 1e-9)) > L, (case, f, start)
            skipped += start
    assert skipped > 10_000  # the start is not trivially 0
