"""A step whose groups are of sizes outside one divisibility chain (SP 3 beside SP 2 on a 6-GPU
node) runs on 6 gloo ranks and matches the single-process reference (the tolerance of
`test_dist_runtime`). Six ranks, unlike the other modules' 2 and 4: sizes 2 and 3 need a node
of 6; the test is not timed."""

from __future__ import annotations

import pytest

from tests.dist import mixed_cases
from tests.dist.harness import Workers
from tests.dist.test_dist_runtime import GRAD_RTOL
from tests.support import make_data, reference, rel_err

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def workers6(tmp_path_factory):
    w = Workers(6, tmp_path_factory.mktemp("rdv6"))
    yield w
    w.close()


def test_sp3_beside_sp2_on_one_node_matches_the_reference(workers6):
    seed = 3
    out = workers6.run(mixed_cases.case_mixed_step, seed)
    plan = out[0]["plan"]
    busy = sorted(tuple(g["ranks"]) for g in plan["groups"] if g["micro_batches"])
    assert (0, 1, 2) in busy and (4, 5) in busy, busy  # 3 at offset 0, 2 at offset 4 (rank 3 alone)
    data = make_data("llama", len(plan["sample_ids"]), seed)
    ref_loss, ref_grads = reference(mixed_cases.six_head_model(), data, list(range(len(plan["sample_ids"]))))
    for r, res in enumerate(out):
        assert res["plan"] == plan  # planned independently on every rank
        assert abs(res["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (r, res["loss"], ref_loss)
        for name, g in res["grads"].items():
            assert rel_err(g, ref_grads[name]) <= GRAD_RTOL, (r, name)
