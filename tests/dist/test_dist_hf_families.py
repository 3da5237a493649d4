"""transformers families with attention beyond a plain causal softmax, on gloo (world
4; random plans with SP 1, 2 and 4, idle ranks, packed documents of uneven lengths,
recompute on and off): Gemma 2 (logit softcapping, with weights large enough that the
capping changes the result), gpt-oss (learned per-head attention sinks: each SP rank uses
its heads' sinks) and DeepSeek-V3 (multi-head latent attention: value heads of another size
than query/key heads). Loss and every parameter's gradient after `sync_gradients()` equal a
single process running the unmodified model (transformers' eager attention) one sample at a
time.

Tolerance: fp32, 1e-5 relative per tensor, as in test_dist_adapters (sharding and packing
reorder sums); a dropped softcap or sink moves gradients by 1e-1 or more (shown below for
the softcap; a sink left out gets no gradient at all, relative error 1).

One world: world 4's plans hold groups of SP 1, 2 and 4 (asserted), so a world-2 pool (SP 1
and 2, the whole world at SP 2) would run no code path that world 4 does not;
the plans of `PARITY_MODES` run the whole world's group inside the "phases" plan."""

from __future__ import annotations

import pytest

from tests import hf_families
from tests.adapter_models import build, make_data, reference
from tests.dist import adapter_cases
from tests.dist.cases_common import PARITY_MODES, assert_matches_reference
from tests.dist.harness import Workers
from tests.support import reference_once, rel_err

pytestmark = pytest.mark.dist

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(4, tmp_path_factory.mktemp("rdv4"))
    yield w
    w.close()


def test_gemma2_softcapping_changes_loss_and_gradients():
    """Without this the parity test below could pass with the softcap dropped."""
    data = make_data("hf-gemma2", 7, 22)
    # the parity test's first reference of Gemma 2 (same key): computed once for both
    capped_loss, capped = reference_once(
        ("hf-families", "hf-gemma2", 22, 7), lambda: reference(build("hf-gemma2"), data, range(7))
    )
    plain_loss, plain = reference(hf_families.build("hf-gemma2", softcap=False), data, range(7))
    assert abs(capped_loss - plain_loss) > 1e-3 * abs(capped_loss), (capped_loss, plain_loss)
    assert max(rel_err(plain[n], capped[n]) for n in capped) > 1e-1


@pytest.mark.parametrize("kind", hf_families.KINDS)
def test_families_match_single_process_gradients(workers, kind):
    seeds, num_samples = [22, 23, 24], 7
    out = workers.run(adapter_cases.case_adapter_engine, kind, seeds, num_samples, PARITY_MODES)
    sp_seen, uneven, rc_seen, worst = set(), False, set(), {}
    for i, seed in enumerate(seeds):
        data = make_data(kind, num_samples, seed)
        ref_loss, ref_grads = reference_once(
            ("hf-families", kind, seed, num_samples), lambda: reference(build(kind), data, range(num_samples))
        )
        plan = out[0][i]["plan"]
        for g in plan["groups"]:
            sp_seen.add(len(g["ranks"]))
            for m in g["micro_batches"]:
                uneven |= len({data.docs[s].shape[0] for s in m["sample_ids"]}) > 1
                rc_seen.add((m["layout"]["recompute"]["attn"], m["layout"]["recompute"]["mlp"]))
        errs = assert_matches_reference(out, i, ref_loss, ref_grads, kind, seed, same_on_ranks=False)
        worst.update({name: max(worst.get(name, 0.0), e) for name, e in errs.items()})
    assert sp_seen == {1, 2, 4}, sp_seen
    assert uneven and (0, 0) in rc_seen and len(rc_seen) >= 3
    top = max(worst, key=worst.get)
    print(
        f"\n{kind} world {workers.world}: max rel err {worst[top]:.2e} ({top})"
        + "".join(f"; {n} {e:.2e}" for n, e in worst.items() if "sinks" in n)
    )
