"""A video dataset of mixed resolutions and frame counts that are not bucket-exact trains a
whole epoch under every policy at world 2, through the public API (profile, plan, load,
train), for the reference DiT (factorized attention) and diffusers' Wan (text-to-video,
Wan 2.1 image-to-video with image embeddings, Wan 2.2 image-to-video with condition
channels), SkyReels-V2, VACE and Helios (Wan look-alikes), LTX-Video and the image
transformers Flux, Flux 2 and Qwen-Image (images of many aspect ratios): lossless — every
sample exactly once — and every micro-batch stacks samples of one latent shape."""

from __future__ import annotations

import math

import pytest

from dcparallel.plan.policies import ALL
from tests.adapter_models import DIT_MIX, MIXES
from tests.dist import video_cases
from tests.dist.harness import Workers

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def workers2(tmp_path_factory):
    w = Workers(2, tmp_path_factory.mktemp("rdv-video"))
    yield w
    w.close()


# the Wan look-alikes (5-6 s each on 2 cores) and Flux 2 (about 20 s) with DCPARALLEL_SLOW=1
@pytest.mark.parametrize("kind", ["dit", "wan", "wan-i2v", "wan22-i2v", pytest.param("skyreels", marks=pytest.mark.slow),
                                  pytest.param("vace", marks=pytest.mark.slow),
                                  pytest.param("helios", marks=pytest.mark.slow), "ltx", "flux", "qwenimage",
                                  pytest.param("flux2", marks=pytest.mark.slow)])
def test_mixed_resolution_epoch_trains_under_every_policy(workers2, kind, tmp_path):
    pytest.importorskip("diffusers")
    out = workers2.run(video_cases.case_video_epoch, kind, str(tmp_path / f"{kind}-profile.json"))
    shapes = (DIT_MIX if kind == "dit" else MIXES[kind]) * 2
    for policy in ALL:
        runs = {}
        for per_rank in out:
            for step, ranks, sids in per_rank[policy]["ran"]:
                runs.setdefault((step, tuple(ranks), tuple(sids)), set()).add(per_rank[policy]["rank"])
        # every rank of a micro-batch's group ran it; every sample exactly once in the epoch
        assert all(ran == set(ranks) for (_, ranks, _), ran in runs.items()), policy
        trained = sorted(s for (_, _, sids) in runs for s in sids)
        assert trained == list(range(len(shapes))), (policy, trained)
        for (_, _, sids) in runs:
            if kind != "dit":
                assert len({shapes[s] for s in sids}) == 1, (policy, [shapes[s] for s in sids])
            else:  # the reference DiT's latent grid: Open-Sora's rule, 16-pixel patches
                grids = {(1 if shapes[s][0] == 1 else shapes[s][0] * 5 // 17, math.ceil(shapes[s][1] / 16),
                          math.ceil(shapes[s][2] / 16)) for s in sids}
                assert len(grids) == 1, (policy, [shapes[s] for s in sids])
        losses = out[0][policy]["losses"]
        assert losses == out[1][policy]["losses"] and all(math.isfinite(x) for x in losses)
