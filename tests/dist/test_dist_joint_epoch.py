"""A mixed-resolution video set (odd and even token counts, several shapes per count) trains
a whole epoch of HunyuanVideo, CogVideoX and Mochi under every policy at world 2 through the
public API (profile, plan, load, train): lossless — every sample exactly once, by every rank
of its group — every micro-batch stacks samples of one latent shape, and both ranks see the
same finite step losses. A policy whose epoch plans are those of a policy before it is not
trained again (`epoch_per_policy`)."""

from __future__ import annotations

import pytest

from tests.dist import joint_cases
from tests.dist.cases_common import assert_lossless_epochs
from tests.joint_models import MIX

pytestmark = pytest.mark.dist

pytest.importorskip("diffusers")


# HunyuanVideo in every run; CogVideoX and Mochi (45-75 s each on 2 cores) with DCPARALLEL_SLOW=1
@pytest.mark.parametrize(
    "kind",
    ["hunyuan", pytest.param("cogvideox", marks=pytest.mark.slow), pytest.param("mochi", marks=pytest.mark.slow)],
)
def test_mixed_resolution_epoch_trains_under_every_policy(workers2, kind, tmp_path):
    out = workers2.run(joint_cases.case_joint_epoch, kind, str(tmp_path / f"{kind}-profile.json"))
    shapes = MIX[kind] * 2
    assert_lossless_epochs(out, shapes, grid=lambda s: shapes[s])
