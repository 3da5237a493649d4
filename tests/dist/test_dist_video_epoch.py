"""A video dataset of mixed resolutions and frame counts that are not bucket-exact trains a
whole epoch under every policy at world 2, through the public API (profile, plan, load,
train), for the reference DiT (factorized attention) and diffusers' Wan (text-to-video,
Wan 2.1 image-to-video with image embeddings, Wan 2.2 image-to-video with condition
channels), SkyReels-V2, VACE and Helios (Wan look-alikes), LTX-Video and the image
transformers Flux, Flux 2 and Qwen-Image (images of many aspect ratios): lossless — every
sample exactly once — and every micro-batch stacks samples of one latent shape. A policy whose
epoch plans are those of a policy before it is not trained again (`epoch_per_policy`)."""

from __future__ import annotations

import math

import pytest

from tests.adapter_models import DIT_MIX, MIXES
from tests.dist import video_cases
from tests.dist.cases_common import assert_lossless_epochs

pytestmark = pytest.mark.dist


# the Wan look-alikes (5-6 s each on 2 cores) and Flux 2 (about 20 s) with DCPARALLEL_SLOW=1
@pytest.mark.parametrize(
    "kind",
    [
        "dit",
        "wan",
        "wan-i2v",
        "wan22-i2v",
        pytest.param("skyreels", marks=pytest.mark.slow),
        pytest.param("vace", marks=pytest.mark.slow),
        pytest.param("helios", marks=pytest.mark.slow),
        "ltx",
        "flux",
        "qwenimage",
        pytest.param("flux2", marks=pytest.mark.slow),
    ],
)
def test_mixed_resolution_epoch_trains_under_every_policy(workers2, kind, tmp_path):
    pytest.importorskip("diffusers")
    out = workers2.run(video_cases.case_video_epoch, kind, str(tmp_path / f"{kind}-profile.json"))
    shapes = (DIT_MIX if kind == "dit" else MIXES[kind]) * 2

    def grid(s: int) -> tuple:
        if kind != "dit":
            return shapes[s]
        f, h, w = shapes[s]  # the reference DiT's latent grid: Open-Sora's rule, 16-pixel patches
        return (1 if f == 1 else f * 5 // 17, math.ceil(h / 16), math.ceil(w / 16))

    assert_lossless_epochs(out, shapes, grid)
