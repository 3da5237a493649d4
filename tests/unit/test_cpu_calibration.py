"""`cost = "analytic"` on a CPU (`profile.cpu_calibration`): the time constants timed here
price the model's layer exactly as measured, are cached and reused, and `prepare` uses them
unless DCPARALLEL_CPU_CALIBRATION=0 (the test suite's default, for machine-independent plans)."""

from __future__ import annotations

import json
import math
import random

import pytest

from dcparallel.cost.analytic import AnalyticCost, fit_calibration
from dcparallel.profile import cpu_calibration as cc
from dcparallel.profile.inputs import reference_spec
from dcparallel.spec import ClusterSpec, Recompute
from tests.unit.test_profile import tiny_llama

CLUSTER = ClusterSpec(world_size=1, gpus_per_node=1, memory_bytes=2**34, intra_bw=1e10, inter_bw=1e10, name="cpu")


def spec_of(model):
    return reference_spec(model, model.layers)[0]


def test_the_measured_constants_price_the_layer_as_measured():
    spec = spec_of(tiny_llama(num_layers=2))
    measured = {"lin_s_per_token": 3e-6, "attn_s_per_pair": 2e-8, "floor_s": 4e-4}
    cost = AnalyticCost(spec, CLUSTER, cc.calibration(spec, measured))
    n = 100
    head = 3e-6 / (spec.attn_params + spec.mlp_params) * spec.vocab_size * spec.hidden * n
    layer = 4e-4 + 3e-6 * n + 2e-8 * n * (n + 1) / 2
    t = cost.terms((n,), 1).time(Recompute(0, 0))
    assert math.isclose(t, spec.num_layers * layer + head, rel_tol=1e-9)
    h200 = AnalyticCost(spec, CLUSTER).terms((n,), 1).time(Recompute(0, 0))
    assert not math.isclose(t, h200, rel_tol=0.5)  # not the packaged prices
    # memory is the packaged calibration's: bytes per token are the model's, not the device's
    assert cost.terms((n,), 1).act_layer == AnalyticCost(spec, CLUSTER).terms((n,), 1).act_layer


def test_timed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "MIN_S", 0.01)  # the same timing code in short windows
    monkeypatch.setattr(cc, "REPEATS", 2)
    monkeypatch.setattr(cc, "TIMING_FLOPS", 2e7)  # and smaller calls
    factors = iter([3.0, 5.0])
    monkeypatch.setattr(cc, "slowdown", lambda spec, measured: next(factors))  # timed at every launch
    spec = spec_of(tiny_llama(num_layers=2))
    path = tmp_path / cc.CACHE_NAME
    first = cc.cpu_calibration(spec, path)
    assert first.name == "cpu" and first.lin_s_per_token > 0 and first.attn_s_per_pair > 0
    (entry,) = json.loads(path.read_text()).values()
    assert set(entry) == {"lin_s_per_token", "attn_s_per_pair", "floor_s", "spread", "probe"}
    assert first.floor_s == pytest.approx(3.0 * entry["floor_s"])  # wall seconds: processor seconds x slowdown

    def no_timing(spec):
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(cc, "measure", no_timing)
    again = cc.cpu_calibration(spec, path)  # the cached constants at this launch's slowdown
    assert again.lin_s_per_token == pytest.approx(first.lin_s_per_token * 5.0 / 3.0)
    assert again.floor_s == pytest.approx(5.0 * entry["floor_s"])
    with pytest.raises(AssertionError, match="timed again"):  # another model's sizes: timed anew
        cc.cpu_calibration(spec_of(tiny_llama(num_layers=2, hidden=64)), path)


def test_prepare_prices_with_this_cpu_unless_asked_not_to(tmp_path, monkeypatch):
    import dcparallel
    from dcparallel.data.synthetic import SyntheticText

    measured = {"lin_s_per_token": 3e-6, "attn_s_per_pair": 2e-8, "floor_s": 4e-4}
    entry = {
        **measured,
        "spread": dict.fromkeys(measured, 0.0),
        "probe": {"tokens": [16, 64], "lengths": [16, 64], "seconds": [1e-3] * 4},
    }
    monkeypatch.setattr(cc, "measure", lambda spec: dict(entry))
    monkeypatch.setattr(cc, "slowdown", lambda spec, m: 2.0)
    lengths = [20, 40, 60, 80]

    def prepared():
        dc = dcparallel.DataCentricParallel(tiny_llama(num_layers=2), policy="dcp")
        dc.prepare(
            SyntheticText(lengths, vocab=64),
            lengths=lengths,
            tokens_per_step=100,
            cost="analytic",
            profile_path=tmp_path / "profile.json",
        )
        return dc.cost.cal

    monkeypatch.setenv("DCPARALLEL_CPU_CALIBRATION", "1")
    cal = prepared()
    assert cal.name == "cpu" and cal.floor_s == 2.0 * measured["floor_s"] and (tmp_path / cc.CACHE_NAME).exists()
    monkeypatch.setenv("DCPARALLEL_CPU_CALIBRATION", "0")
    assert prepared() == fit_calibration("llama-7b")


class FakeClock:
    """A clock only the timed function moves: its i-th call takes ``cost(i)`` seconds."""

    def __init__(self, cost):
        self.now, self.calls, self.cost = 0.0, 0, cost

    def __call__(self) -> float:
        return self.now

    def fn(self) -> None:
        self.now += self.cost(self.calls)
        self.calls += 1


def test_the_least_call_of_a_window_is_the_works_own_cost():
    # 10 ms of work a call; two calls in three interrupted by other work, 1.5-4x as long
    c = FakeClock(lambda i: 0.01 if i % 3 == 0 else 0.01 * (1.5 + i % 5 / 2))
    (best,) = cc.timed_rounds([c.fn], repeats=5, min_s=0.1, clock=c, work=c).estimate()
    assert best == pytest.approx(0.01)  # the mean per call would be about 0.02


def test_a_round_with_no_undisturbed_call_does_not_move_the_estimate():
    # 10 ms a call; every call of the second round (calls 12-22) held up 2x by other work
    c = FakeClock(lambda i: 0.02 if 12 <= i < 23 else 0.01)
    rounds = cc.timed_rounds([c.fn], repeats=5, min_s=0.1, clock=c, work=c)
    assert max(rounds.best[0]) == pytest.approx(0.02) and rounds.estimate() == [pytest.approx(0.01)]


def test_a_window_is_bounded_by_its_time_and_calls():
    c = FakeClock(lambda i: 1.0)  # a call longer than a window: MIN_CALLS a window, plus the warm-up
    cc.timed_rounds([c.fn], repeats=5, min_s=0.2, clock=c, work=c)
    assert c.calls == 1 + 5 * cc.MIN_CALLS
    c = FakeClock(lambda i: 0.003)
    rounds = cc.timed_rounds([c.fn], repeats=5, min_s=0.2, clock=c, work=c)
    assert 5 * 0.2 <= c.now <= 0.003 + 5 * (0.2 + 0.003)  # the warm-up, then five windows that stop at 0.2 s
    assert rounds.wall_s == pytest.approx(c.now - 0.003)


def test_processor_time_per_call_whatever_share_of_a_core_each_window_gets():
    # 10 ms of work a call; the share of the core the process gets changes from window to window
    wall, work = FakeClock(lambda i: 0.01 / (0.1 if i // 5 % 2 else 1.0)), FakeClock(lambda i: 0.01)

    def fn():
        wall.fn()
        work.fn()

    rounds = cc.timed_rounds([fn], repeats=5, min_s=0.05, clock=wall, work=work)
    assert rounds.estimate() == [pytest.approx(0.01, rel=1e-9)]
    assert rounds.wall_s > 4 * work.now  # the wall clock saw the slow windows (a tenth of the core)


def test_the_slowdown_is_wall_seconds_per_calibrated_processor_second(monkeypatch):
    # calls that take their calibrated work, at a quarter of a core, one in two 1.5x longer (interrupted)
    wall, work = FakeClock(lambda i: 0.0), [0.0]

    def builder(scale: float):
        def make(x: int):
            def fn():
                took = scale * x * (1.5 if fn.calls % 2 else 1.0)
                fn.calls += 1
                work[0] += took
                wall.now += took / 0.25

            fn.calls = 0
            return fn

        return make

    monkeypatch.setattr(cc, "_timed_fns", lambda spec: (builder(1e-4), builder(1e-5)))
    probe = {"tokens": [16, 64], "lengths": [16, 64], "seconds": [1.6e-3, 6.4e-3, 1.6e-4, 6.4e-4]}
    factor = cc.slowdown(None, {"probe": probe}, clock=wall, work=lambda: work[0])
    assert 4.0 * 1.1 < factor < 4.0 * 1.5  # a quarter of a core, and the interrupted calls' extra work


#: the demo layer's sizes as `measure` times them (tokens, attention lengths: the floor's first)
TOKENS, LENGTHS = [16, 128, 256, 512], [16, 256, 512, 1024]
#: time constants in processor seconds of a layer like the demo's on this machine
TRUE = {"lin_s_per_token": 2e-5, "attn_s_per_pair": 4.5e-8, "floor_s": 4e-4}


def noisy_calibration(seed: int, share: tuple[float, float]) -> tuple[dict, dict, float]:
    """`measure`'s rounds and fit on fake calls whose work follows `TRUE` exactly, disturbed
    as a loaded machine disturbs them: half the calls interrupted (1.1-3x their work; in
    a bad stretch of the scheduler all of them), the share of the core redrawn from
    ``share`` now and then. Returns the fit, the same fit of each size's mean work per call,
    and the wall seconds per work second."""
    rng = random.Random(seed)
    clock = FakeClock(lambda i: 0.0)
    work, spent = [0.0], [[0.0, 0] for _ in range(8)]
    state = {"share": 1.0, "bad": False}

    def call(i: int, seconds: float):
        def fn():
            took = seconds * (rng.uniform(1.1, 3.0) if state["bad"] or rng.random() < 0.5 else 1.0)
            work[0] += took
            spent[i][0], spent[i][1] = spent[i][0] + took, spent[i][1] + 1
            clock.now += took / state["share"]
            if rng.random() < 0.05:  # the scheduler: another share, now and then a bad stretch
                state["share"], state["bad"] = rng.uniform(*share), rng.random() < 0.1

        return fn

    floor_lin, floor_att = 0.7 * TRUE["floor_s"], 0.3 * TRUE["floor_s"]
    lin = [floor_lin + TRUE["lin_s_per_token"] * x for x in TOKENS]
    att = [floor_att + TRUE["attn_s_per_pair"] * x * (x + 1) / 2 for x in LENGTHS]
    rounds = cc.timed_rounds([call(i, t) for i, t in enumerate(lin + att)], clock=clock, work=lambda: work[0])
    means = cc.fit([w / n for w, n in spent], TOKENS, LENGTHS)
    return cc.robust_fit(rounds, TOKENS, LENGTHS), means, clock.now / work[0]


def test_the_fit_is_stable_under_injected_noise():
    """Two calibrations of the same work under different loads (a core shared 0.3-1 and
    0.03-0.2) agree within 10 % on every constant and lie within 10 % of the work's own,
    although half the calls took 1.1-3x their work (each size's mean per call is off by more
    than 30 %) and the wall seconds per work second differ threefold; each states its spread."""
    quiet, quiet_means, quiet_wall = noisy_calibration(1, (0.3, 1.0))
    busy, busy_means, busy_wall = noisy_calibration(2, (0.03, 0.2))
    assert busy_wall > 3 * quiet_wall  # the loads differ
    for k, v in TRUE.items():
        assert quiet[k] == pytest.approx(v, rel=0.1), k
        assert busy[k] == pytest.approx(v, rel=0.1), k
        assert max(quiet[k], busy[k]) / min(quiet[k], busy[k]) - 1 <= 0.1, k
        assert 0 <= busy["spread"][k] <= 0.1, k
    assert abs(busy_means["lin_s_per_token"] / TRUE["lin_s_per_token"] - 1) > 0.3  # the noise is not small
