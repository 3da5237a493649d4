"""Library models through their adapters on gloo (world 4): a transformers Llama with
grouped-query attention (8 query, 2 key/value heads: SP 4 exceeds the key/value heads, so
they are repeated), a transformers Qwen3 (per-head q/k norms, GQA), diffusers transformers
on whole latents of mixed shapes and odd token counts, their sequence sharded inside the model
by hooks applying the model's `_cp_plan`, Ulysses in their attention processors — Wan
text-to-video, Wan 2.1 image-to-video (image embeddings), Wan 2.2 image-to-video (condition
channels), Wan 2.2 TI2V (per-token timesteps from the user's loss), ChronoEdit (Wan
image-to-video with its own rotary tables), SkyReels-V2 text-to-video (five-argument blocks,
fps embedding) and image-to-video (image embeddings, condition channels), VACE (control
blocks whose hints are added to the video tokens), Helios (its own plan: tokens cut at each
self-attention, whole in between), LTX-Video (masked text) and the image transformers with
joint text + image attention on images of several aspect ratios — Flux, Flux 2 (fused
single-stream blocks, 4-axis positions, guidance) and Qwen-Image (dual-stream blocks, a text
mask of any pattern, a complex rotary table per stream) — and a user's own
module following the protocol. Loss and every parameter's gradient after `sync_gradients()`
equal a single process running the unmodified model one sample at a time.

Tolerance: fp32 throughout; sharding reorders sums (attention per head group, loss and
gradients over shards, ranks and micro-batches, packed vs separate documents), a few fp32
roundings per value. Measured well below 1e-5 relative per tensor; a lost shard, a target
counted twice or a document attending across a boundary moves gradients by 1e-3 or more.

One world: world 4's plans hold groups of SP 1, 2 and 4 (asserted), so a world-2 pool (SP 1
and 2, the whole world at SP 2) would run no code path that world 4 does not;
the plans of `PARITY_MODES` run the whole world's group inside the "phases" plan."""

from __future__ import annotations

import re

import pytest

from tests.adapter_models import TEXT_KINDS, build, make_data, reference
from tests.dist import adapter_cases
from tests.dist.cases_common import PARITY_MODES, assert_matches_reference
from tests.dist.harness import Workers
from tests.support import reference_once

pytestmark = pytest.mark.dist

pytest.importorskip("transformers")
pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(4, tmp_path_factory.mktemp("rdv4"))
    yield w
    w.close()


@pytest.mark.parametrize(
    "kind",
    [
        "hf-llama",
        "hf-qwen3",
        "wan",
        "wan-i2v",
        "wan22-i2v",
        "wan-ti2v",
        "chronoedit",
        "skyreels",
        "skyreels-i2v",
        "vace",
        "helios",
        "ltx",
        "flux",
        "flux2",
        "qwenimage",
        "custom",
    ],
)
def test_library_models_match_single_process_gradients(workers, kind):
    seeds, num_samples = [22, 23, 24], 7
    out = workers.run(adapter_cases.case_adapter_engine, kind, seeds, num_samples, PARITY_MODES)
    sp_seen, idle, uneven, rc_seen, worst = set(), False, False, set(), 0.0
    for i, seed in enumerate(seeds):
        data = make_data(kind, num_samples, seed)
        ref_loss, ref_grads = reference_once(
            ("adapters", kind, seed, num_samples), lambda: reference(build(kind), data, range(num_samples))
        )
        plan = out[0][i]["plan"]
        uneven |= len({len(g["micro_batches"]) for g in plan["groups"]}) > 1
        for g in plan["groups"]:
            sp_seen.add(len(g["ranks"]))
            idle |= not g["micro_batches"]
            rc_seen |= {(m["layout"]["recompute"]["attn"], m["layout"]["recompute"]["mlp"]) for m in g["micro_batches"]}
            if kind not in TEXT_KINDS:  # micro-batches hold one latent shape
                assert all(len({data.shape_of[s] for s in m["sample_ids"]}) == 1 for m in g["micro_batches"])
        worst = max(worst, *assert_matches_reference(out, i, ref_loss, ref_grads, kind, seed).values())
    print(f"{kind} world {workers.world}: max rel err per gradient tensor {worst:.1e}")
    assert sp_seen == {1, 2, 4}, sp_seen
    assert idle and uneven and len(rc_seen) >= 3


@pytest.mark.parametrize(
    "kind,inputs", [("skyreels", {"enable_diffusion_forcing": True}), ("helios", {"latents_history_short": "latents"})]
)
def test_inputs_the_plan_does_not_cut_are_refused_inside_an_sp_group(workers, kind, inputs):
    """SkyReels-V2's diffusion forcing and Helios' history latents: refused inside an SP group
    (naming the class, the input and the fix), never run with unsharded per-token inputs."""
    name = next(iter(inputs))
    for msg in workers.run(adapter_cases.case_refused_inside_sp, kind, inputs):
        assert re.search(
            rf"Transformer3DModel with {name} is not supported by dcparallel inside an SP group: .+; "
            rf"train without it, or plan SP 1",
            msg,
        ), msg
