"""LoRA and frozen parameters on gloo (world 2 and 4): PEFT LoRA on a transformers Llama with
grouped-query attention, DoRA with LoRA on the token embeddings, a diffusers Wan given LoRA in
place, and a Llama whose embeddings and first block are frozen — at shard size 1 (the flat
buffers) and 2 (FSDP2 blocks holding the frozen weights too), on random plans with SP 1 and 2
(and 4) in one step, recompute on and off. Loss and every trainable parameter's gradient after
`sync_gradients()` equal a single process running the unmodified PEFT model one sample at a
time (fp32, 1e-5 relative per tensor); after an AdamW step every frozen parameter is bit for
bit unchanged and every trainable one moved. A bf16 frozen base under fp32 adapters trains at
both shard sizes, and so does a forward under bf16 autocast (the Trainer's bf16=True) on a
plan with SP 1 and 2 (4). Gradient and optimizer bytes per rank are the adapters' only."""

from __future__ import annotations

import pytest
import torch

from tests import adapter_models, lora_models
from tests.dist import lora_cases
from tests.dist.harness import Workers
from tests.support import reference_once, rel_err

pytestmark = pytest.mark.dist

pytest.importorskip("peft")

NUM_SAMPLES = 6
#: (shard size, seeds, recompute per seed: random per micro-batch, or off); one seed per kind,
#: planned at each shard size (whole blocks of 1 or 2 ranks) against one reference, whose
#: plans recompute some micro-batches and not others
RUNS = {
    "lora-llama": [(1, [31], [True]), (2, [31], [True])],
    "lora-wan": [(1, [41], [True]), (2, [41], [True])],
    "dora-emb-llama": [(1, [53], [True]), (2, [53], [True])],
    "frozen-llama": [(1, [63], [True]), (2, [63], [False])],
}
#: the autocast test's seed: its fp32 reference is lora-llama's above
AUTOCAST_SEED = RUNS["lora-llama"][0][1][0]


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["world2", "world4"])
def workers(request, tmp_path_factory):
    """World 2 in `make test`; world 4 (the same checks, SP 4 too) with DCPARALLEL_SLOW=1."""
    w = Workers(request.param, tmp_path_factory.mktemp(f"rdv{request.param}"))
    yield w
    w.close()


def _reference(kind: str, seed: int) -> tuple[float, dict]:
    def compute():
        model = lora_models.build(kind)
        data = adapter_models.make_data(lora_models.BASE[kind], NUM_SAMPLES, seed)
        loss, grads = adapter_models.reference(model, data, range(NUM_SAMPLES))
        return loss, {n: grads[n] for n in lora_models.trainable_names(model)}

    return reference_once(("lora", kind, seed), compute)


@pytest.mark.parametrize("kind", lora_models.KINDS)
def test_trainable_gradients_match_and_frozen_unchanged(workers, kind):
    sp_mixed, rc_seen, worst = False, set(), 0.0
    for shard_size, seeds, recompute in RUNS[kind]:
        if shard_size > 1 and workers.world < shard_size:
            continue
        out = workers.run(lora_cases.case_lora_parity, kind, shard_size, seeds, NUM_SAMPLES, recompute)
        for r, res in enumerate(out):
            assert res["frozen"], kind  # the model has frozen parameters
            assert res["frozen_unchanged"], (kind, shard_size, r)
            assert res["min_trained_change"] > 0, (kind, shard_size, r)
            assert res["attention_verified"], (kind, shard_size, r)
        for i, seed in enumerate(seeds):
            ref_loss, ref_grads = _reference(kind, seed)
            plan = out[0]["steps"][i]["plan"]
            sizes = {len(g["ranks"]) for g in plan["groups"] if g["micro_batches"]}
            sp_mixed |= {1, 2} <= sizes if shard_size == 1 else len(sizes) > 1
            rc_seen |= {
                bool(m["layout"]["recompute"]["attn"] or m["layout"]["recompute"]["mlp"])
                for g in plan["groups"]
                for m in g["micro_batches"]
            }
            for r, res in enumerate(out):
                step = res["steps"][i]
                assert abs(step["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (kind, shard_size, seed, r)
                assert set(step["grads"]) == set(ref_grads), (kind, sorted(set(step["grads"]) ^ set(ref_grads)))
                for name, g in step["grads"].items():
                    e = rel_err(g, ref_grads[name])
                    worst = max(worst, e)
                    assert e <= 1e-5, f"{kind} shard {shard_size} seed {seed} rank {r} {name}: {e:.2e} plan {plan}"
    assert sp_mixed and rc_seen == {True, False}, (sp_mixed, rc_seen)
    print(f"\n{kind} world {workers.world}: max rel err {worst:.2e}")


@pytest.mark.parametrize("shard_size", [1, 2])
def test_bf16_frozen_base_with_fp32_adapters(workers, shard_size):
    """Accepted and trained: the frozen base stays bf16 and bit for bit unchanged, the adapters
    stay fp32; the gradients are those of the same mixed model in one process up to bf16
    rounding of the base's matmuls (5e-2 relative per tensor)."""
    if workers.world != 2:
        pytest.skip("one world is enough for the dtype handling")
    out = workers.run(lora_cases.case_mixed_dtype_step, "lora-llama", shard_size, 71, NUM_SAMPLES)
    ref_loss, ref_grads = reference_once(  # the same reference at both shard sizes
        ("lora-bf16", 71),
        lambda: adapter_models.reference(
            lora_models.build("lora-llama", base_dtype=torch.bfloat16),
            adapter_models.make_data("hf-llama", NUM_SAMPLES, 71),
            range(NUM_SAMPLES),
        ),
    )
    for res in out:
        assert res["frozen_dtypes"] == ["torch.bfloat16"] and res["trainable_dtypes"] == ["torch.float32"]
        assert res["frozen_unchanged"]
        assert abs(res["loss"] - ref_loss) <= 1e-2 * abs(ref_loss), (res["loss"], ref_loss)
        worst = max(rel_err(g, ref_grads[n]) for n, g in res["grads"].items())
        assert worst <= 5e-2, worst
    print(f"\nbf16 base, shard {shard_size}: loss {out[0]['loss']:.5f} vs {ref_loss:.5f}, max rel err {worst:.2e}")


def _autocast_reference(seed: int) -> tuple[float, dict]:
    def compute():
        model = lora_models.build("lora-llama")
        data = adapter_models.make_data("hf-llama", NUM_SAMPLES, seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, grads = adapter_models.reference(model, data, range(NUM_SAMPLES))
        return loss, {n: grads[n] for n in lora_models.trainable_names(model)}

    return reference_once(("lora-autocast", seed), compute)


def test_autocast_bf16_forward_with_sp_mixed(workers):
    """DataCentricTrainer's bf16=True path: each forward under autocast to bfloat16 on a plan
    with SP 1 and SP > 1 in one step, recompute as planned and off. The gradients stay fp32;
    against the single process under the same autocast (one sample at a time) they differ by
    bf16 rounding only: less than the single process's own distance to fp32."""
    out = workers.run(lora_cases.case_autocast_step, AUTOCAST_SEED, NUM_SAMPLES)
    ref_loss, ref_grads = _autocast_reference(AUTOCAST_SEED)
    fp32_loss, fp32_grads = _reference("lora-llama", AUTOCAST_SEED)
    bf16_vs_fp32 = max(rel_err(g, fp32_grads[n]) for n, g in ref_grads.items())
    recompute, worst = set(), 0.0
    for i, run in enumerate(out[0]):
        groups = run["plan"]["groups"]
        sizes = {len(g["ranks"]) for g in groups if g["micro_batches"]}
        assert 1 in sizes and max(sizes) > 1, sizes  # SP 1 and 2 at world 2 (1 and 4 at world 4)
        recompute |= {
            bool(m["layout"]["recompute"]["attn"] or m["layout"]["recompute"]["mlp"])
            for g in groups
            for m in g["micro_batches"]
        }
        for res in (runs[i] for runs in out):
            assert res["dtypes"] == ["torch.float32"] and set(res["grads"]) == set(ref_grads)
            assert abs(res["loss"] - ref_loss) <= 1e-3 * abs(ref_loss), (res["loss"], ref_loss)
            worst = max([worst] + [rel_err(g, ref_grads[n]) for n, g in res["grads"].items()])
    assert recompute == {True, False}, recompute  # torch's checkpoint recomputes under the autocast
    print(
        f"\nautocast world {workers.world}: loss {out[0][0]['loss']:.6f}, one process {ref_loss:.6f}, fp32 "
        f"{fp32_loss:.6f}; max rel err {worst:.2e} (one process's to fp32: {bf16_vs_fp32:.2e})"
    )
    assert worst <= bf16_vs_fp32, (worst, bf16_vs_fp32)


@pytest.mark.parametrize("shard_size", [1, 2])
def test_gradient_and_optimizer_bytes_are_the_adapters(workers, shard_size):
    """Measured from the tensors held after a step at world 2: the fp32 gradient buffer holds the
    adapters (padded to the world, + loss and count at shard size 1) and the optimizer state
    (two fp32 moments; no master copy of fp32 adapters) the adapters' share of this rank."""
    if workers.world != 2:
        pytest.skip("measured at world 2")
    out = workers.run(lora_cases.case_state_bytes, "lora-llama", shard_size)
    for res in out:
        n, w = res["adapter_numel"], res["world"]
        per_rank = -(-n // w)
        if shard_size == 1:
            assert res["grad_bytes"] == 4 * (per_rank * w + 2)
        else:  # this rank's half of every adapter, padded to the replicas (one: the block is the world)
            assert res["grad_bytes"] == 4 * n // shard_size
        assert res["optimizer_bytes"] == 8 * (per_rank if shard_size == 1 else n // shard_size)
        assert res["grad_bytes"] + res["optimizer_bytes"] < 0.3 * 12 * res["model_numel"] / w
    r = out[0]
    print(
        f"\nshard {shard_size}: adapters {r['adapter_numel']} of {r['model_numel']} parameters; per rank "
        f"gradients {r['grad_bytes']} B, optimizer {r['optimizer_bytes']} B"
    )


def test_prepare_refuses_adapters_initialized_apart(workers):
    """Adapters drawn from each rank's own generator: replicas that would train different
    weights; `prepare` names it and the fix."""
    if workers.world != 2:
        pytest.skip("one world is enough")
    for msg in workers.run(lora_cases.case_prepare_refuses_diverged_adapters):
        assert "trainable parameters" in msg and "torch.manual_seed" in msg, msg
