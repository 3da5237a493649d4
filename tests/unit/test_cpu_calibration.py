"""`cost = "analytic"` on a CPU (`profile.cpu_calibration`): the time constants timed here
price the model's layer exactly as measured, are cached and reused, and `prepare` uses them
unless DCPARALLEL_CPU_CALIBRATION=0 (the test suite's default, for machine-independent plans)."""

from __future__ import annotations

import json
import math

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
    spec = spec_of(tiny_llama(num_layers=2))
    path = tmp_path / cc.CACHE_NAME
    first = cc.cpu_calibration(spec, path)
    assert first.name == "cpu" and first.lin_s_per_token > 0 and first.attn_s_per_pair > 0
    (entry,) = json.loads(path.read_text()).values()
    assert set(entry) == {"lin_s_per_token", "attn_s_per_pair", "floor_s"}

    def no_timing(spec):
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(cc, "measure", no_timing)
    assert cc.cpu_calibration(spec, path) == first
    with pytest.raises(AssertionError, match="timed again"):  # another model's sizes: timed anew
        cc.cpu_calibration(spec_of(tiny_llama(num_layers=2, hidden=64)), path)


def test_prepare_prices_with_this_cpu_unless_asked_not_to(tmp_path, monkeypatch):
    import dcparallel
    from dcparallel.data.synthetic import SyntheticText

    measured = {"lin_s_per_token": 3e-6, "attn_s_per_pair": 2e-8, "floor_s": 4e-4}
    monkeypatch.setattr(cc, "measure", lambda spec: dict(measured))
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
    assert cal.name == "cpu" and cal.floor_s == measured["floor_s"] and (tmp_path / cc.CACHE_NAME).exists()
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


def test_windows_average_over_a_shared_core_where_single_calls_do_not():
    # a core shared in turns: 4 calls at a third of the speed, then 4 alone; 10 ms a call on average
    def clock():
        return FakeClock(lambda i: 0.015 if i % 8 < 4 else 0.005)

    c = clock()
    assert cc.robust_time(c.fn, repeats=5, min_s=1.0, clock=c) == pytest.approx(0.01, rel=0.03)
    c = clock()  # windows of one call each: the median of five single calls catches the slow turn
    assert cc.robust_time(c.fn, repeats=5, min_s=0.0, clock=c) == pytest.approx(0.015)


def test_the_median_drops_windows_a_burst_fell_into():
    # 10 ms a call; two calls (in two different windows) held up 2 s by other work
    c = FakeClock(lambda i: 2.0 if i in (30, 75) else 0.01)
    assert cc.robust_time(c.fn, repeats=5, min_s=0.2, clock=c) == pytest.approx(0.01, rel=1e-9)


def test_the_timing_is_bounded_by_its_windows():
    c = FakeClock(lambda i: 1.0)  # a call longer than a window: one call a window, plus the warm-up
    assert cc.robust_time(c.fn, repeats=5, min_s=0.2, clock=c) == 1.0 and c.calls == 6
    c = FakeClock(lambda i: 0.003)
    cc.robust_time(c.fn, repeats=5, min_s=0.2, clock=c)
    assert c.now <= 0.003 + 5 * (0.2 + 0.003)  # the warm-up, then five windows that stop at 0.2 s
    assert c.now >= 5 * 0.2


def test_processor_time_per_call_whatever_share_of_a_core_each_window_gets():
    # 10 ms of work a call; the share of the core the process gets changes from window to window
    wall, work = FakeClock(lambda i: 0.01 / (0.1 if i // 5 % 2 else 1.0)), FakeClock(lambda i: 0.01)

    def fn():
        wall.fn()
        work.fn()

    assert cc.robust_time(fn, repeats=5, min_s=0.05, clock=wall, work_clock=work) == pytest.approx(0.01, rel=1e-9)
    assert wall.now > 5 * work.now  # the wall clock saw the slow windows (a tenth of the core)


def test_rounds_give_every_size_the_same_load():
    # two sizes, 1 and 4 units of work; from 15 s on, the machine's load makes each unit 3 s
    def timed(together: bool) -> tuple[float, float]:
        clock = FakeClock(lambda i: 0.0)

        def call(units: float):
            clock.now += units * (1.0 if clock.now < 15.0 else 3.0)

        fns = [lambda: call(1.0), lambda: call(4.0)]
        if together:
            return tuple(cc.robust_times(fns, repeats=5, min_s=1.0, clock=clock))
        return tuple(cc.robust_time(fn, repeats=5, min_s=1.0, clock=clock) for fn in fns)

    small, large = timed(together=True)
    assert large / small == pytest.approx(4.0, rel=1e-9)  # the slope of the two sizes is the work's
    small, large = timed(together=False)  # one size after the other: the load changed in between
    assert large / small == pytest.approx(12.0, rel=1e-9)
