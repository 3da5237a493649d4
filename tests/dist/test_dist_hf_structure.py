"""transformers families whose decoder blocks live elsewhere or whose sub-modules have other
names, found from the model's structure and driven on gloo (world 4): GPT-NeoX
(``gpt_neox.layers``, ``attention``, partial rotary, parallel residual), GraniteMoE
(``block_sparse_moe``, attention / residual / embedding / logit multipliers) and Llama 4
text (``feed_forward`` MoE with a shared expert, chunked attention, a no-RoPE layer). Plans
mix SP 1, 2 and 4 with idle ranks, uneven micro-batch counts, packed documents of 2-37
tokens and random attention / MLP / full recompute; loss and every parameter's gradient
after `sync_gradients()` equal a single process running the unmodified model one document
at a time (fp32, relative error per tensor <= 1e-5: the tolerance of
`test_dist_adapters`).

One world: world 4's plans hold groups of SP 1, 2 and 4 (asserted), so a world-2 pool (SP 1
and 2, the whole world at SP 2) would run no code path that world 4 does not;
the plans of `PARITY_MODES` run the whole world's group inside the "phases" plan."""

from __future__ import annotations

import pytest

from tests.dist import hf_structure_cases
from tests.dist.cases_common import PARITY_MODES, assert_matches_reference
from tests.dist.harness import Workers
from tests.hf_structure_families import PARITY, build, make_data, reference
from tests.support import reference_once

pytestmark = pytest.mark.dist

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(4, tmp_path_factory.mktemp("rdv4"))
    yield w
    w.close()


@pytest.mark.parametrize("kind", list(PARITY))
def test_structure_families_match_single_process_gradients(workers, kind):
    seeds, num_samples = [42, 43, 44], 7
    out = workers.run(hf_structure_cases.case_family_engine, kind, seeds, num_samples, PARITY_MODES)
    sp_seen, rc_seen, worst = set(), set(), 0.0
    for i, seed in enumerate(seeds):
        ref_loss, ref_grads = reference_once(
            ("hf-structure", kind, seed, num_samples),
            lambda: reference(build(kind), make_data(num_samples, seed), range(num_samples)),
        )
        plan = out[0][i]["plan"]
        for g in plan["groups"]:
            sp_seen.add(len(g["ranks"]))
            rc_seen |= {(m["layout"]["recompute"]["attn"], m["layout"]["recompute"]["mlp"]) for m in g["micro_batches"]}
        worst = max(worst, *assert_matches_reference(out, i, ref_loss, ref_grads, kind, seed).values())
    packed = any(
        len(m["sample_ids"]) > 1
        for i in range(len(seeds))
        for g in out[0][i]["plan"]["groups"]
        for m in g["micro_batches"]
    )
    assert packed
    assert sp_seen == {1, 2, 4}, sp_seen
    assert (0, 0) in rc_seen and len(rc_seen) >= 3, rc_seen
    print(f"\n{kind} world {workers.world}: max rel err {worst:.2e}")
