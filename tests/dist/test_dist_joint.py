"""diffusers video transformers with joint video + text attention under Ulysses on gloo
(world 4): HunyuanVideo (dual- then single-stream blocks, text padding masks, guidance),
CogVideoX 1.0 and 1.5 (rotary tables of the pipeline) and Mochi (caption masks anywhere in
the caption, its text output compacted as diffusers does). Video tokens are sharded over the
SP group (odd counts padded, the padding masked), text tokens replicated, and each rank
attends over all video tokens and the text for its heads. Loss and every parameter's gradient
after `sync_gradients()` equal a single process running the unmodified model one sample at a
time (plans with SP 1, 2 and 4, idle ranks, several phases, random recompute). World 4 only:
its plans hold groups of SP 1, 2 and 4 (asserted), so a world-2 plan (SP 1 and 2, the whole
world at SP 2) runs no code path these do not: the same hooks, Ulysses exchange and head
split at SP 2 (a sub-group here), SP = the whole world (SP 4), idle ranks.

Tolerance: fp32; sharding reorders sums (attention per head group and over a padded key set,
loss and gradients over shards, ranks and micro-batches), a few fp32 roundings per value.
The text stream's gradient counted once per rank of a group instead of once per group (or a
lost video shard) moves gradients by far more than 1e-5. A key bias with no key norm after it
(HunyuanVideo's token refiner) has a zero gradient in exact arithmetic (softmax ignores a
shift shared by a query's keys): its values are rounding noise on both sides, so tensors whose
reference gradient is below 1e-6 of the whole gradient's norm are held to 1e-5 of that norm.

Under ring attention (`runtime.ring_joint`): the same families and Flux, Qwen-Image and Flux 2
(slow), one step with (u, r) = (2, 2) and (1, 4) on the whole world (recompute on the
second) and (1, 2) on half the world, against the same reference (a world-2 step, (1, 2) on
the whole world with and without recompute, runs the same ring code: u = 1, the whole world,
recompute); HunyuanVideo also at world 8 (slow)."""

from __future__ import annotations

import pytest
import torch

from tests import adapter_models, joint_models
from tests.dist import joint_cases
from tests.dist.cases_common import assert_matches_reference
from tests.dist.harness import Workers
from tests.joint_models import JOINT_KINDS, build, make_data, reference
from tests.support import reference_once, rel_err

pytestmark = pytest.mark.dist

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(4, tmp_path_factory.mktemp("rdv4"))
    yield w
    w.close()


@pytest.mark.parametrize("kind", JOINT_KINDS)
def test_joint_attention_matches_single_process_gradients(workers, kind):
    seeds, num_samples = [31, 32, 33, 34], 7
    out = workers.run(joint_cases.case_joint_engine, kind, seeds, num_samples)
    sp_seen, rc_seen, worst = set(), set(), 0.0
    for i, seed in enumerate(seeds):
        data = make_data(kind, num_samples, seed)
        ref_loss, ref_grads = reference_once(
            ("joint", kind, seed, num_samples), lambda: reference(build(kind), data, range(num_samples))
        )
        plan = out[0][i]["plan"]
        for g in plan["groups"]:
            sp_seen.add(len(g["ranks"]))
            rc_seen |= {(m["layout"]["recompute"]["attn"], m["layout"]["recompute"]["mlp"]) for m in g["micro_batches"]}
            assert all(len({data.shape_of[s] for s in m["sample_ids"]}) == 1 for m in g["micro_batches"])
        total = torch.cat([x.flatten() for x in ref_grads.values()]).norm()

        def err(g, ref, total=total):
            return rel_err(g, ref) if ref.norm() > 1e-6 * total else float((g - ref).norm() / total)

        worst = max(worst, *assert_matches_reference(out, i, ref_loss, ref_grads, kind, seed, err=err).values())
    print(f"{kind} world {workers.world}: max rel err {worst:.2e}")
    assert sp_seen == {1, 2, 4}, sp_seen
    assert len(rc_seen) >= 3, rc_seen


# Flux 2 (about 20 s a world on 2 cores) with DCPARALLEL_SLOW=1
@pytest.mark.parametrize("kind", [*JOINT_KINDS, "flux", "qwenimage", pytest.param("flux2", marks=pytest.mark.slow)])
def test_joint_attention_under_ring_matches_single_process_gradients(workers, kind):
    """Ring degree 2 on the whole world ((2, 2)), ring = world with every block recomputed,
    ring 2 on half the world: each video ring block's queries
    see the replicated text once, the text's queries every block (`runtime.ring_joint`)."""
    _assert_ring_step(workers.run(joint_cases.case_joint_ring, kind, 41), kind, 41, workers.world)


@pytest.mark.slow  # eight workers importing diffusers on 2 cores
def test_hunyuan_video_under_ring_at_world8(tmp_path_factory):
    """(4, 2) and (1, 8) on the whole world, (2, 2) on half of it."""
    w = Workers(8, tmp_path_factory.mktemp("rdv-joint8"))
    try:
        out = w.run(joint_cases.case_joint_ring, "hunyuan", 43)
    finally:
        w.close()
    _assert_ring_step(out, "hunyuan", 43, 8)


def _assert_ring_step(out: list[dict], kind: str, seed: int, world: int) -> None:
    models = joint_models if kind in JOINT_KINDS else adapter_models
    ref_loss, ref_grads = reference_once(
        ("joint-ring", kind, seed),
        lambda: models.reference(models.build(kind), models.make_data(kind, 3, seed), range(3)),
    )
    total = torch.cat([x.flatten() for x in ref_grads.values()]).norm()
    worst = 0.0
    for r, res in enumerate(out):
        assert abs(res["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (kind, r, res["loss"], ref_loss)
        assert set(res["grads"]) == set(ref_grads)
        for name, g in res["grads"].items():
            ref = ref_grads[name]
            e = rel_err(g, ref) if ref.norm() > 1e-6 * total else float((g - ref).norm() / total)
            assert e <= 1e-5, (kind, r, name, e)
            worst = max(worst, e)
    print(f"{kind} ring, world {world}: max rel err {worst:.2e}")
