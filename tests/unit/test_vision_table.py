"""The vision tower measured per patch bucket (`profile.vision.measure_tower`) and priced from
the measurement (`cost.vision.VisionTable`, `VisionPrice.from_table`): a measured table changes
a micro-batch's price by exactly what it measured, scalar and array arithmetic alike."""

import dataclasses

import numpy as np
import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.batch import Batches
from dcparallel.cost.vision import VisionTable, fit_nonnegative
from dcparallel.spec import VisionSize

from ._models import cluster
from .test_vision_cost import LM, TOWER, VLM

#: measured coefficients the synthetic tables are made of: seconds and kept bytes per patch
#: and per attention pair of one image
S_PATCH, S_PAIR, B_PATCH, B_PAIR = 2e-6, 3e-13, 5e4, 1e-3
BUCKETS = (1024, 4096, 9216)
SAMPLES = [VisionSize(1500, (4096,)), VisionSize(3000, (9216, 1024)), VisionSize(800, (1024,))]


def _table(scale: float = 1.0, trainable: bool = True) -> VisionTable:
    pairs = [TOWER.pairs(p) for p in BUCKETS]
    return VisionTable(
        BUCKETS,
        tuple(scale * (S_PATCH * p + S_PAIR * q) for p, q in zip(BUCKETS, pairs)),
        tuple(B_PATCH * p + B_PAIR * q for p, q in zip(BUCKETS, pairs)),
        trainable,
    )


def _work(sizes, sp: int) -> tuple[float, float]:
    """(patches, pairs) the slowest rank of an sp group encodes: 1/sp of all, or the largest image."""
    patches = [p for s in sizes for p in s.patches]
    pairs = [TOWER.pairs(p) for p in patches]
    return max(sum(patches) / sp, max(patches)), max(sum(pairs) / sp, max(pairs))


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_a_measured_table_prices_the_tower_as_measured(sp):
    c = cluster(8)
    text_only = AnalyticCost(LM, c)  # the same tokens, no tower: the language model's share
    measured = AnalyticCost(VLM, c, vision_table=_table())
    doubled = AnalyticCost(VLM, c, vision_table=_table(scale=2.0))
    analytic = AnalyticCost(VLM, c)
    base = text_only.terms([int(s) for s in SAMPLES], sp)
    got = measured.terms(SAMPLES, sp)
    vp, vq = _work(SAMPLES, sp)
    assert got.time_none - base.time_none == pytest.approx(S_PATCH * vp + S_PAIR * vq, rel=1e-9)
    keeps_nothing = AnalyticCost(VLM, c, vision_table=dataclasses.replace(_table(), kept_bytes=(0.0,) * 3))
    kept = got.fixed_bytes - keeps_nothing.terms(SAMPLES, sp).fixed_bytes  # the same model states
    assert kept == pytest.approx(B_PATCH * vp + B_PAIR * vq, rel=1e-9)
    assert doubled.terms(SAMPLES, sp).time_none - base.time_none == pytest.approx(
        2 * (S_PATCH * vp + S_PAIR * vq), rel=1e-9
    )
    assert got.time_none != pytest.approx(analytic.terms(SAMPLES, sp).time_none, rel=1e-3)  # the table decides
    # the array arithmetic of the planners prices it bit for bit alike
    grid = measured.terms_grid(Batches.of(VLM, [SAMPLES, SAMPLES[:1]]), [sp])
    assert grid.time_none[0, 0] == got.time_none and grid.fixed_bytes[0, 0] == got.fixed_bytes
    copies = measured.terms_copies(SAMPLES[1], 3, sp)
    assert copies == measured.terms([SAMPLES[1]] * 3, sp)


def test_a_table_must_match_the_tower_it_prices():
    c = cluster(8)
    with pytest.raises(ValueError, match="measured frozen but is planned trainable"):
        AnalyticCost(VLM, c, vision_table=_table(trainable=False))
    frozen = dataclasses.replace(VLM, vision=dataclasses.replace(TOWER, trainable=False))
    AnalyticCost(frozen, c, vision_table=_table(trainable=False))
    with pytest.raises(ValueError, match="has no vision tower"):
        AnalyticCost(LM, c, vision_table=_table())
    with pytest.raises(ValueError, match="two or more distinct patch buckets"):
        VisionTable((1024,), (0.1,), (1.0,), True)
    assert VisionTable.from_json(_table().to_json()) == _table()


def test_the_fit_keeps_coefficients_non_negative():
    x1, x2 = [1.0, 2.0, 3.0], [1.0, 4.0, 9.0]
    assert fit_nonnegative(x1, x2, [2 * a + 0.5 * b for a, b in zip(x1, x2)]) == pytest.approx((2.0, 0.5))
    a, b = fit_nonnegative(x1, x2, [3.0, 5.0, 6.0])  # concave: a negative pair term fits best unconstrained
    assert b == 0.0 and a > 0
    y = np.array([3.0, 5.0, 6.0])
    assert a == pytest.approx(float(np.dot(x1, y) / np.dot(x1, x1)))


def test_the_tower_of_a_tiny_qwen25_vl_is_measured_per_bucket():
    pytest.importorskip("transformers")
    from dcparallel.profile.vision import measure_tower
    from tests import vlm_families as vlmf

    model = vlmf.build("qwen2.5-vl")
    table = measure_tower(model, (16, 60, 256), repeats=1)
    assert table.patches == (16, 64, 256) and table.trainable  # square grids of whole 2 x 2 merge blocks
    assert table.kept_bytes[0] < table.kept_bytes[1] < table.kept_bytes[2]
    assert all(p.grad is None for p in model.parameters())  # nothing left for a training step to add
    frozen = measure_tower(vlmf.build("qwen2.5-vl", freeze_vision=True), (16, 64), repeats=1)
    assert not frozen.trainable and frozen.kept_bytes[1] < table.kept_bytes[1]  # only the merger keeps inputs
    next(model.parameters()).grad = next(model.parameters()).detach().clone()
    with pytest.raises(ValueError, match="holds gradients"):
        measure_tower(model, (16, 64), repeats=1)
    with pytest.raises(ValueError, match="no grid-based vision tower"):
        measure_tower(vlmf.build("internvl"), (16, 64), repeats=1)


def test_a_profile_with_a_measured_tower_prices_vision_samples(tmp_path):
    """A `Profile` holding the tower's table (and its model spec the tower) prices a
    `VisionSize` as the language model's measured terms plus the table's tower; saved and
    loaded, it prices alike. Without a table a vision sample stays refused."""
    import json

    from dcparallel.cost.profiled import ProfiledCost
    from dcparallel.cost.schema import Profile

    from .test_cost import _profile

    tower = dataclasses.replace(TOWER, num_layers=2, full_layers=1, window=64)
    d = _profile()
    d["model"]["vision"] = dataclasses.asdict(tower)
    d["vision"] = VisionTable(
        BUCKETS,
        tuple(S_PATCH * p + S_PAIR * tower.pairs(p) for p in BUCKETS),
        tuple(B_PATCH * p + B_PAIR * tower.pairs(p) for p in BUCKETS),
        True,
    ).to_json()
    (tmp_path / "p.json").write_text(json.dumps(Profile.from_json(d).to_json()))
    profile = Profile.load(tmp_path / "p.json")
    assert profile.model.vision == tower and profile.vision.patches == BUCKETS
    c, text = ProfiledCost(profile, cluster(2, 2)), ProfiledCost(Profile.from_json(_profile()), cluster(2, 2))
    samples = [VisionSize(1500, (4096,)), VisionSize(1200, (1024, 256)), 900]
    for sp in (1, 2):
        base, got = text.terms([int(s) for s in samples], sp), c.terms(samples, sp)
        patches = [4096, 1024, 256]
        vp = max(sum(patches) / sp, 4096)
        vq = max(sum(tower.pairs(p) for p in patches) / sp, tower.pairs(4096))
        assert got.time_none - base.time_none == pytest.approx(S_PATCH * vp + S_PAIR * vq, rel=1e-9)
        assert got.fixed_bytes - base.fixed_bytes == pytest.approx(B_PATCH * vp + B_PAIR * vq, rel=1e-9)
        assert dataclasses.replace(got, time_none=base.time_none, fixed_bytes=base.fixed_bytes) == base
        grid = c.terms_grid(Batches.of(profile.model, [samples, [900]]), [sp])
        assert grid.time_none[0, 0] == got.time_none and grid.time_none[1, 0] == text.terms([900], sp).time_none
        assert c.terms_copies(samples[0], 3, sp) == c.terms([samples[0]] * 3, sp)
    with pytest.raises(ValueError, match="not a vision tower"):
        text.terms([samples[0]], 1)
