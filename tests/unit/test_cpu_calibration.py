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
