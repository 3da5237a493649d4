"""A mixed-resolution video set (odd and even token counts, several shapes per count) trains
a whole epoch of HunyuanVideo, CogVideoX and Mochi under every policy at world 2 through the
public API (profile, plan, load, train): lossless — every sample exactly once, by every rank
of its group — every micro-batch stacks samples of one latent shape, and both ranks see the
same finite step losses."""

from __future__ import annotations

import math

import pytest

from dcparallel.plan.policies import ALL
from tests.dist import joint_cases
from tests.dist.harness import Workers
from tests.joint_models import MIX

pytestmark = pytest.mark.dist

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def workers2(tmp_path_factory):
    w = Workers(2, tmp_path_factory.mktemp("rdv-joint"))
    yield w
    w.close()


# HunyuanVideo in every run; CogVideoX and Mochi (45-75 s each on 2 cores) with DCPARALLEL_SLOW=1
@pytest.mark.parametrize("kind", ["hunyuan", pytest.param("cogvideox", marks=pytest.mark.slow),
                                  pytest.param("mochi", marks=pytest.mark.slow)])
def test_mixed_resolution_epoch_trains_under_every_policy(workers2, kind, tmp_path):
    out = workers2.run(joint_cases.case_joint_epoch, kind, str(tmp_path / f"{kind}-profile.json"))
    shapes = MIX[kind] * 2
    for policy in ALL:
        runs: dict[tuple, set[int]] = {}
        for per_rank in out:
            for step, ranks, sids in per_rank[policy]["ran"]:
                runs.setdefault((step, tuple(ranks), tuple(sids)), set()).add(per_rank[policy]["rank"])
        assert all(ran == set(ranks) for (_, ranks, _), ran in runs.items()), policy
        trained = sorted(s for (_, _, sids) in runs for s in sids)
        assert trained == list(range(len(shapes))), (policy, trained)
        for (_, _, sids) in runs:
            assert len({shapes[s] for s in sids}) == 1, (policy, [shapes[s] for s in sids])
        losses = out[0][policy]["losses"]
        assert losses == out[1][policy]["losses"] and all(math.isfinite(x) for x in losses)
