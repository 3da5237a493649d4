"""`cost = "analytic"` on a CPU (`profile.cpu_calibration`): the time constants timed here
price the model's layer exactly as measured, are cached and reused, and `prepare` uses them
unless DCPARALLEL_CPU_CALIBRATION=0 (the test suite's default, for machine-independent plans)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics

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
    measured = {"lin_s_per_token": 3e-6, "attn_s_per_pair": 2e-8, "floor_s": 4e-4, "attn_call_s": 1e-4}
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
    monkeypatch.setattr(cc, "KNOT_FLOPS", 1e7)  # attention's knots up to 128 tokens
    monkeypatch.setattr(cc, "slowdown", lambda spec, measured: 5.0)  # timed at a launch that reads the cache
    spec = spec_of(tiny_llama(num_layers=2))
    path = tmp_path / cc.CACHE_NAME
    first = cc.cpu_calibration(spec, path)
    assert first.name == "cpu" and first.lin_s_per_token > 0 and first.attn_s_per_pair > 0
    (entry,) = json.loads(path.read_text()).values()
    assert set(entry) == {*cc.CONSTANTS, "spread", "probe", "attn_knots"}
    assert [x for x, _ in entry["attn_knots"]] == [64, 128] and first.attn_knots == tuple(
        map(tuple, entry["attn_knots"])
    )
    factor = first.floor_s / entry["floor_s"]  # wall seconds: processor seconds x the calibration's slowdown
    assert factor >= 1.0 and first.attn_s_per_pair > 0

    def no_timing(spec, longest):
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(cc, "measure", no_timing)
    again = cc.cpu_calibration(spec, path)  # the cached constants at this launch's slowdown
    assert again.lin_s_per_token == pytest.approx(first.lin_s_per_token * 5.0 / factor)
    assert again.floor_s == pytest.approx(5.0 * entry["floor_s"])
    with pytest.raises(AssertionError, match="timed again"):  # another model's sizes: timed anew
        cc.cpu_calibration(spec_of(tiny_llama(num_layers=2, hidden=64)), path)


def test_prepare_prices_with_this_cpu_unless_asked_not_to(tmp_path, monkeypatch):
    import dcparallel
    from dcparallel.data.synthetic import SyntheticText

    measured = {"lin_s_per_token": 3e-6, "attn_s_per_pair": 2e-8, "floor_s": 4e-4, "attn_call_s": 1e-4}
    entry = {
        **measured,
        "spread": dict.fromkeys(measured, 0.0),
        "probe": {"tokens": [16, 64], "lengths": [16, 64], "seconds": [1e-3] * 4},
        "slowdown": 2.0,  # the calibration's own windows, wall seconds per processor second
    }
    monkeypatch.setattr(cc, "measure", lambda spec, longest: dict(entry, attn_knots=[[64, 1.0], [128, 1.0]]))
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


def test_the_least_window_drops_the_windows_a_burst_fell_into():
    # 10 ms a call; the calls of the second round's window held up 2x by other work
    c = FakeClock(lambda i: 0.02 if 11 <= i < 16 else 0.01)
    rounds = cc.timed_rounds([c.fn], repeats=5, min_s=0.1, clock=c, work=c)
    assert max(rounds.per_call[0]) > 0.015 and rounds.estimate() == [pytest.approx(0.01)]


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
TRUE = {"lin_s_per_token": 2e-5, "attn_s_per_pair": 4.5e-8, "floor_s": 4e-4, "attn_call_s": 1.2e-4}
#: the share of windows a burst of other work catches whole
BURSTS = 0.2


def noisy_calibration(seed: int, share: tuple[float, float]) -> tuple[dict, dict, float]:
    """`measure`'s rounds and fit on fake calls whose work follows `TRUE`, disturbed as a loaded
    machine disturbs them: every call up to 10 % over its work, one window in five caught
    whole by a burst of other work (its calls 1.5-3x their work), each window at a share of
    the core drawn from ``share``. Returns the fit, the same fit of each size's mean work per call over
    all its calls, and the wall seconds per work second."""
    rng = random.Random(seed)
    clock = FakeClock(lambda i: 0.0)
    work, spent = [0.0], [[0.0, 0] for _ in range(8)]
    state = {"share": 1.0, "burst": 1.0, "fn": None}

    def call(i: int, seconds: float):
        def fn():
            if state["fn"] != i:  # a new window: its share, and now and then a burst
                state.update(fn=i, share=rng.uniform(*share))
                state["burst"] = rng.uniform(1.5, 3.0) if rng.random() < BURSTS else 1.0
            took = seconds * rng.uniform(1.0, 1.1) * state["burst"]
            work[0] += took
            spent[i][0], spent[i][1] = spent[i][0] + took, spent[i][1] + 1
            clock.now += took / state["share"]

        return fn

    floor_lin, floor_att = TRUE["floor_s"] - TRUE["attn_call_s"], TRUE["attn_call_s"]
    lin = [floor_lin + TRUE["lin_s_per_token"] * x for x in TOKENS]
    att = [floor_att + TRUE["attn_s_per_pair"] * x * (x + 1) / 2 for x in LENGTHS]
    rounds = cc.timed_rounds([call(i, t) for i, t in enumerate(lin + att)], clock=clock, work=lambda: work[0])
    means = cc.fit([w / n for w, n in spent], TOKENS, LENGTHS)
    return cc.robust_fit(rounds, TOKENS, LENGTHS), means, clock.now / work[0]


def test_the_fit_is_stable_under_injected_noise():
    """Ten pairs of calibrations of the same work under different loads (a core shared 0.3-1
    and 0.03-0.2): every constant within 10 % of the work's own, and each pair within 10 % of
    each other, although one window in five took 1.5-3x its work (the same fit of each
    size's mean per call is off by 15 % and more on average) and the wall seconds per work
    second differ threefold."""
    off = []
    for seed in range(10):
        quiet, _, quiet_wall = noisy_calibration(seed, (0.3, 1.0))
        busy, busy_means, busy_wall = noisy_calibration(100 + seed, (0.03, 0.2))
        assert busy_wall > 3 * quiet_wall  # the loads differ
        for k, v in TRUE.items():
            assert quiet[k] == pytest.approx(v, rel=0.1), (seed, k)
            assert busy[k] == pytest.approx(v, rel=0.1), (seed, k)
            assert max(quiet[k], busy[k]) / min(quiet[k], busy[k]) - 1 <= 0.1, (seed, k)
            assert busy["spread"][k] >= 0, (seed, k)
        off.append(abs(busy_means["lin_s_per_token"] / TRUE["lin_s_per_token"] - 1))
    assert statistics.fmean(off) > 0.15  # the noise is not small


@pytest.mark.parametrize("lengths", [(40,), (40, 9, 23, 17, 5)])
def test_a_packed_micro_batch_is_priced_at_the_attention_calls_the_runtime_makes(monkeypatch, lengths):
    """One packed row of these documents through the engine at world 1 on CPU: the SDPA calls
    each layer makes (counted around `scaled_dot_product_attention`) are the calls the CPU
    calibration's cost model prices, each beyond the first at the calibrated fixed cost."""
    import torch

    from dcparallel.data.collate import resolve_collate
    from dcparallel.plan.types import MicroBatch
    from dcparallel.runtime.engine import Engine
    from dcparallel.spec import Layout

    model = tiny_llama(num_layers=2)
    spec = spec_of(model)
    calls, sdpa = [0], torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    dc = Engine(model)
    docs = {i: torch.randint(0, spec.vocab_size, (n,)) for i, n in enumerate(lengths)}
    batch = resolve_collate("text", "text")(docs, MicroBatch(tuple(docs), Layout(1, 1)), (0,), 0)
    with torch.no_grad(), dc.micro_batch(batch) as ctx:
        dc.adapter.loss_fn(model, batch, ctx)
    assert calls[0] == spec.num_layers * len(lengths)  # the CPU kernel: one SDPA call per document

    measured = {"lin_s_per_token": 3e-6, "attn_s_per_pair": 2e-8, "floor_s": 4e-4, "attn_call_s": 1e-4}
    cal = cc.calibration(spec, measured)
    cost = AnalyticCost(spec, CLUSTER, cal)
    assert cost.attention_calls(len(lengths)) * spec.num_layers == calls[0]
    one_call = AnalyticCost(spec, CLUSTER, dataclasses.replace(cal, attn_calls_per_document=False))
    extra = cost.terms(lengths, 1).time(Recompute(0, 0)) - one_call.terms(lengths, 1).time(Recompute(0, 0))
    assert extra == pytest.approx(spec.num_layers * (calls[0] // spec.num_layers - 1) * 1e-4, rel=1e-9, abs=1e-15)


def _knotted(spec, lengths=(64, 128, 256, 512, 1024, 2048, 4096)):
    """A calibration whose attention over one document of each of ``lengths`` took these
    seconds: a fixed cost and a cost per pair falling with the length (as SDPA's on a CPU)."""
    per_pair = {x: 2e-8 * (1.8 if x <= 256 else 1.0 if x <= 1024 else 0.8) for x in lengths}
    seconds = [1e-4 + per_pair[x] * x * (x + 1) / 2 for x in lengths]
    measured = {"lin_s_per_token": 3e-6, "attn_s_per_pair": 1.5e-8, "floor_s": 4e-4, "attn_call_s": 1e-4}
    measured["attn_knots"] = cc.fit_knots(list(lengths), seconds, measured)
    return cc.calibration(spec, measured), dict(zip(lengths, seconds, strict=True))


def test_attention_is_priced_at_each_length_as_timed():
    """The knots: a document of a timed length is priced at its timed attention (its call's
    fixed cost and its pairs at its own length's cost per pair), not at one slope; between
    two knots in between their costs per pair, past the last at the last's."""
    spec = spec_of(tiny_llama(num_layers=2))
    cal, seconds = _knotted(spec)
    no_attn = dataclasses.replace(cal, attn_s_per_pair=0.0)
    for x, t in seconds.items():
        with_attn = AnalyticCost(spec, CLUSTER, cal).terms((x,), 1).time(Recompute(0, 0))
        without = AnalyticCost(spec, CLUSTER, no_attn).terms((x,), 1).time(Recompute(0, 0))
        assert with_attn - without == pytest.approx(spec.num_layers * (t - 1e-4), rel=1e-9)
    cost = AnalyticCost(spec, CLUSTER, cal)
    per_pair = [cost.priced_pairs(x, x * (x + 1) / 2) / (x * (x + 1) / 2) for x in (256, 400, 512, 4096, 8192)]
    assert per_pair[0] > per_pair[1] > per_pair[2] and per_pair[3] == pytest.approx(per_pair[4], rel=1e-12)
    one_slope = AnalyticCost(spec, CLUSTER, dataclasses.replace(cal, attn_knots=()))
    assert one_slope.priced_pairs(3000, 1e6) == 1e6  # without knots every length at one slope


def test_knots_price_micro_batches_one_at_a_time_and_all_at_once_alike():
    from dcparallel.cost.batch import Batches

    spec = spec_of(tiny_llama(num_layers=2))
    cost = AnalyticCost(spec, CLUSTER, _knotted(spec)[0])
    batches = [[100, 3000], [64], [5000, 20, 700, 700], [33] * 7]
    grid = cost.terms_grid(Batches.of(spec, batches), [1, 2])
    for i, b in enumerate(batches):
        for j, sp in enumerate((1, 2)):
            assert grid.time_none[i, j] == cost.terms(b, sp).time_none
    copies = cost.terms_copies_grid([33], [7], 1)
    assert copies.time_none[0, 0] == cost.terms_copies(33, 7, 1).time_none == cost.terms([33] * 7, 1).time_none


def test_knots_reach_the_longest_sample_within_a_call_s_work():
    small = spec_of(tiny_llama(num_layers=2))
    assert cc.knot_lengths(small, 3072) == [64, 128, 256, 512, 1024, 2048, 4096]
    assert cc.knot_lengths(small, 100) == [64, 128]
    assert cc.knot_lengths(small, 10**6)[-1] == cc.MAX_KNOT
    wide = dataclasses.replace(small, hidden=8192)  # 6 h L^2 over KNOT_FLOPS: halved
    assert cc.knot_lengths(wide, 4096)[-1] ** 2 * 6 * 8192 <= cc.KNOT_FLOPS


def _cache_entry(knots: list) -> dict:
    """A cached calibration entry as `measure` writes it, with these attention knots."""
    return {
        "lin_s_per_token": 3e-6,
        "attn_s_per_pair": 2e-8,
        "floor_s": 4e-4,
        "attn_call_s": 1e-4,
        "spread": dict.fromkeys(cc.CONSTANTS, 0.0),
        "probe": {"tokens": [16], "lengths": [16], "seconds": [1e-3, 1e-3]},
        "attn_knots": knots,
        "slowdown": 1.0,
    }


def test_a_cache_without_knots_as_long_as_the_run_s_samples_is_timed_anew(tmp_path, monkeypatch):
    spec = spec_of(tiny_llama(num_layers=2))
    entry = _cache_entry([[64, 1.2], [128, 1.0]])
    timed = []
    monkeypatch.setattr(cc, "measure", lambda spec, longest: timed.append(longest) or dict(entry))
    monkeypatch.setattr(cc, "slowdown", lambda spec, measured: 1.0)
    path = tmp_path / cc.CACHE_NAME
    cal = cc.cpu_calibration(spec, path, longest=100)
    assert timed == [100] and cal.attn_knots == ((64, 1.2), (128, 1.0))
    cc.cpu_calibration(spec, path, longest=128)  # covered by the cache
    assert timed == [100]
    cc.cpu_calibration(spec, path, longest=1000)  # a longer sample than the cache's knots
    assert timed == [100, 1000]


def test_dcparallel_train_keeps_the_calibration_with_the_run_s_outputs(tmp_path, monkeypatch):
    """`dcparallel train` with cost = "analytic" and no profile path: the calibration cache
    is written in the run's out_dir, not in the directory it was started from."""
    from dcparallel.apps.train_config import Config
    from tests.faults import run

    entry = _cache_entry([[64, 1.0]])
    monkeypatch.setattr(cc, "measure", lambda spec, longest=cc.MAX_KNOT: dict(entry))
    monkeypatch.setenv("DCPARALLEL_CPU_CALIBRATION", "1")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    cfg = Config.from_dict(
        {
            "model": {"num_layers": 2, "hidden": 32, "num_heads": 2, "ffn_hidden": 64},
            "data": {"num_samples": 20},
            "train": {"tokens_per_step": 1500, "out_dir": str(tmp_path / "run"), "max_steps": 1},
            "profile": {"cost": "analytic"},
        }
    )
    assert run(cfg) == 0
    assert (tmp_path / "run" / cc.CACHE_NAME).exists()
    assert list((tmp_path / "cwd").iterdir()) == []
