"""Vision-language models on gloo (world 4): Qwen2.5-VL, Qwen2-VL, Qwen3-VL, InternVL,
Idefics3, SmolVLM, LLaVA-OneVision (any-resolution tiles packed by the model's own code) and
Gemma 3 (each image one 4-token block, bidirectional inside, under a
sliding window of 3) on random plans (SP 1, 2 and 4, idle ranks, packed chats, recompute on
and off) of a mix of text-only chats, single images of three resolutions (tiled families: 1, 2
and 5 tiles; Idefics3 / SmolVLM: each image's last tile padded, its pixel mask zero there, and
an all-zero padding tile after several images), several images in one chat and (Qwen) a short
video, the vision tower trainable and frozen (its projectors trainable). Loss and every trainable parameter's
gradient after `sync_gradients()`, vision tower included, equal a single process running
the unmodified model one chat at a time (its own M-RoPE positions from the grids).

Tolerance: fp32, 1e-5 relative per tensor, as in test_dist_hf_families (sharding, packing
and encoding several images in one call reorder sums); a gradient that is zero in exact
arithmetic (the SigLIP-like towers' key biases: softmax ignores a shift shared by every key;
below 1e-6 of the whole gradient's norm) is held to 1e-5 of the whole gradient's norm instead.

One world for the parity test: world 4's plans hold groups of SP 1, 2 and 4 (asserted), so a
world-2 pool (SP 1 and 2, the whole world at SP 2) would run no code path that world 4 does not;
trainable towers run the plans of `PARITY_MODES` (the whole world's group inside the "phases"
plan), frozen ones a plan of the whole world alone."""

from __future__ import annotations

import pytest
import torch

from dcparallel.data.vision_collate import collate_vision
from dcparallel.plan.types import MicroBatch
from dcparallel.spec import Layout, Recompute
from tests import vlm_families
from tests.dist import vlm_cases
from tests.dist.cases_common import PARITY_MODES, assert_matches_reference
from tests.dist.harness import Workers
from tests.support import reference_once, rel_err

pytestmark = pytest.mark.dist

pytest.importorskip("transformers")

SEEDS, NUM_SAMPLES = [31, 32, 33, 34], 8
TOWER_BLOCKS = (
    "model.visual.blocks.",
    "model.vision_tower.encoder.",
    "model.vision_model.encoder.",
    "model.vision_tower.vision_model.encoder.",
)
VISION = (
    "model.visual.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.vision_model.",
    "model.connector.",
)


@pytest.fixture(scope="module")
def workers4(tmp_path_factory):
    w = Workers(4, tmp_path_factory.mktemp("rdv4"))
    yield w
    w.close()


def _owners(data, sids, sp: int) -> set[int]:
    """The ranks in a group of ``sp`` that encode the chats' images and videos (the collate's deal)."""
    mb = MicroBatch(tuple(sids), Layout(sp, 1, Recompute.none()))
    batch = collate_vision({s: vlm_families.item(data, s) for s in sids}, mb, tuple(range(sp)), 0)
    return set(batch.extras["vision_owner"].tolist())


@pytest.mark.parametrize("freeze_vision", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("kind", vlm_families.KINDS)
def test_vlm_matches_single_process_gradients(workers4, kind, freeze_vision):
    # frozen: one plan of the whole world's group (the exchange, frozen)
    seeds, modes = (SEEDS[1:], PARITY_MODES) if not freeze_vision else (SEEDS[:1], ("world",))
    out = workers4.run(vlm_cases.case_vlm_engine, kind, seeds, NUM_SAMPLES, freeze_vision, modes)
    sp_seen, rc_seen, dealt, worst = set(), set(), False, {}
    for i, seed in enumerate(seeds):
        data = vlm_families.make_data(NUM_SAMPLES, seed, kind)
        ref_loss, ref_grads = reference_once(
            ("vlm", kind, seed, freeze_vision),
            lambda: vlm_families.reference(
                vlm_families.build(kind, freeze_vision=freeze_vision), data, range(NUM_SAMPLES)
            ),
        )
        assert any(n.startswith(TOWER_BLOCKS) for n in ref_grads) != freeze_vision
        plan = out[0][i]["plan"]
        for g in plan["groups"]:
            sp_seen.add(len(g["ranks"]))
            for m in g["micro_batches"]:
                rc_seen.add((m["layout"]["recompute"]["attn"], m["layout"]["recompute"]["mlp"]))
                dealt |= len(_owners(data, m["sample_ids"], len(g["ranks"]))) > 1
        total = torch.cat([g.flatten() for g in ref_grads.values()]).norm()

        def err(g, ref, total=total):
            return rel_err(g, ref) if ref.norm() > 1e-6 * total else float((g - ref).norm() / total)

        errs = assert_matches_reference(out, i, ref_loss, ref_grads, kind, seed, err=err, same_on_ranks=False)
        worst.update({name: max(worst.get(name, 0.0), e) for name, e in errs.items()})
    if not freeze_vision:
        assert sp_seen == {1, 2, 4}, sp_seen
        assert dealt and (0, 0) in rc_seen and len(rc_seen) >= 3, (dealt, rc_seen)
    top = max(worst, key=worst.get)
    vis = max((e for n, e in worst.items() if n.startswith(VISION)), default=0.0)
    print(
        f"\n{kind} {'frozen' if freeze_vision else 'trainable'} world {workers4.world}: max rel err "
        f"{worst[top]:.2e} ({top}); vision tower {vis:.2e}"
    )


@pytest.mark.slow  # a profile and an epoch: about 25 s of the pool's time on a loaded 2-core machine
def test_vlm_epoch_through_the_public_api(workers2, tmp_path):
    """Every chat trained once in an epoch planned by `dcp` on a profile of the model, its
    batches collated by the loader's workers; every rank sees the same step losses (world 2:
    the loader's path is the same at world 4; the parity test above covers the SP degrees)."""
    out = workers2.run(vlm_cases.case_vlm_epoch, "qwen2.5-vl", 16, str(tmp_path / "profile.json"))
    runs: dict[tuple, int] = {}
    for per_rank in out:
        for step, ranks, sids, _ in per_rank["ran"]:
            runs[(step, tuple(ranks), tuple(sids))] = runs.get((step, tuple(ranks), tuple(sids)), 0) + 1
    assert all(n == len(ranks) for (_, ranks, _), n in runs.items())
    assert sorted(s for (_, _, sids) in runs for s in sids) == list(range(16))
    assert out[0]["losses"] == out[1]["losses"]
    assert out[0]["vision"] is not None and out[0]["vision"] == out[1]["vision"]  # one measured tower
