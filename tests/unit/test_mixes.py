"""The mixes of `dcparallel/mixes.py` as `scenarios.MIXES` and `simulate` take them: shapes and
lengths within what their sources publish, every shape drawable, and `dcp` planning them
losslessly at 16 GPUs."""

import argparse

import numpy as np
import pytest

from dcparallel.mixes import NEW_MIXES, OPENSORA_RESOLUTIONS
from dcparallel.scenarios import ALL_DISTRIBUTIONS, MIXES, SCENARIOS, distinct_shapes, long_token_share, sample_sizes
from tests.unit._models import check_dcp_epoch


def test_new_mixes_are_scenarios():
    assert set(NEW_MIXES) <= set(MIXES) and set(NEW_MIXES) <= set(ALL_DISTRIBUTIONS)


def test_image_buckets_span_256_to_2048_squared_in_tens_of_shapes():
    mix = MIXES["image-buckets"]
    sizes = sample_sizes("video", "image-buckets", num_samples=20_000)
    assert all(f == 1 for f, _, _ in sizes)
    assert set(sizes) == set(mix.shapes()) and 30 <= len(mix.shapes()) <= 60
    areas = [h * w for _, h, w in sizes]
    assert min(areas) >= 0.7 * 256**2 and max(areas) <= 1.3 * 2048**2
    assert all(h % 64 == 0 and w % 64 == 0 for _, h, w in sizes)
    ratios = {round(w / h, 2) for _, h, w in sizes}
    assert min(ratios) <= 0.5 and max(ratios) >= 2.0  # 1:2 portrait to 2:1 landscape


def test_opensora_stage3_keeps_its_bucket_config():
    """Shapes only where the config has a bucket: clips of 408 frames only up to 360p and 512,
    no clip above 1024's area, 1080p and 2048 images only; images at the image share."""
    mix = MIXES["opensora-stage3"]
    sizes = sample_sizes("video", "opensora-stage3", num_samples=20_000)
    assert set(sizes) <= set(mix.shapes()) and len(set(sizes)) >= 0.9 * len(mix.shapes()) >= 100
    area = {name: h * w for name, h, w in OPENSORA_RESOLUTIONS}
    clips = [(f, h * w) for f, h, w in sizes if f > 1]
    assert {f for f, _ in clips} == {51, 102, 204, 408}
    assert max(a for f, a in clips if f == 408) <= 1.1 * area["512"]
    assert max(a for _, a in clips) <= 1.1 * area["1024"]
    assert max(h * w for f, h, w in sizes) >= 0.9 * area["2048"]
    assert 0.27 < sum(f == 1 for f, _, _ in sizes) / len(sizes) < 0.33
    assert distinct_shapes(SCENARIOS["video"].model, sizes) == len(set(sizes))


@pytest.mark.parametrize(
    "name,top,median,long_share", [("long-cpt", 512 * 1024, 1000, 0.4), ("sft-chat-long", 128 * 1024, 1200, 0.2)]
)
def test_text_blends_have_their_long_documents(name, top, median, long_share):
    sizes = np.array(sample_sizes("text", name, num_samples=50_000))
    assert sizes.min() >= 16 and sizes.max() <= top
    assert np.median(sizes) < median
    assert long_token_share(SCENARIOS["text"].model, sizes.tolist(), threshold=8192) > long_share


#: the mixes whose epoch (and its lower bound) takes over 5 s here run with DCPARALLEL_SLOW=1
SLOW = {"opensora-stage3", "long-cpt"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(NEW_MIXES)]
)
def test_dcp_plans_every_new_mix_losslessly(name):
    kind = MIXES[name].kind
    sc = SCENARIOS[kind]
    sizes = tuple(sample_sizes(kind, name, num_samples=2000 if kind == "video" else 1200))
    check_dcp_epoch(sc.model, sizes, sc.cluster(16), seed=0, steps_per_epoch=2)


def test_simulate_takes_a_new_mix_by_name():
    from dcparallel.apps.simulate import _setup

    ns = argparse.Namespace(
        scenario=None,
        distribution="opensora-stage3",
        lengths=None,
        world=8,
        gpus_per_node=8,
        seed=0,
        tokens_per_step=None,
        profile=None,
    )
    name, workload, *_ = _setup(ns)
    assert name == "opensora-stage3" and workload.model.kind == "video"
