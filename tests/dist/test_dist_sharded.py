"""Parameters and gradients sharded in blocks of ``shard_size`` ranks (FSDP2, `runtime.sharded`)
on gloo at world 4: the step's loss and every parameter's full gradient (`Engine.full_gradients`)
equal a single process running the unmodified model one sample at a time, for the reference
DiT, a transformers Llama with grouped-query attention and the diffusers Wan transformer;
`clip_grad_norm_` returns the single-process global norm and clips as torch does; AdamW steps
(`ShardedAdamW`, driven by a torch LR scheduler) match torch's AdamW and the unsharded path;
checkpoints (`runtime.sharded_checkpoint`) resume at another shard size and world size; plans
that split a block are refused (engine and loader).

With shard_size 2 the blocks are {0, 1} and {2, 3}: the plans (whole blocks only) mix SP 2
and SP 4 in one step, give the blocks different micro-batch counts, leave a block idle in some
step, and recompute at random or not at all. With shard_size 4 the one block is the world.

Tolerance: fp32; sharding reorders sums (reduce-scatters per micro-batch, attention per head
group, shards and ranks), a few fp32 roundings per value: measured below 3e-6 relative per
tensor. A lost micro-batch, an averaged instead of summed reduce-scatter or a missing replica
moves gradients by 1e-2 or more."""

from __future__ import annotations

import math

import pytest
import torch

from tests import adapter_models, support
from tests.dist import sharded_cases, sharded_profile_cases
from tests.dist.harness import Workers
from tests.support import rel_err

pytestmark = pytest.mark.dist

SEEDS, NUM_SAMPLES = [21, 22, 23, 24], 7
RECOMPUTE = [True, False, True, True]  # the second step recomputes nothing


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = Workers(4, tmp_path_factory.mktemp("rdv4"))
    yield w
    w.close()


def _reference(kind: str, seed: int):
    if kind in sharded_cases.SUPPORT_KINDS:
        return support.reference(
            support.make_model(kind), support.make_data(kind, NUM_SAMPLES, seed), list(range(NUM_SAMPLES))
        )
    return adapter_models.reference(
        adapter_models.build(kind), adapter_models.make_data(kind, NUM_SAMPLES, seed), range(NUM_SAMPLES)
    )


def _check_parity(workers, kind: str, shard_size: int) -> float:
    out = workers.run(sharded_cases.case_sharded_parity, kind, shard_size, SEEDS, NUM_SAMPLES, RECOMPUTE)
    worst = 0.0
    sp_seen, idle_block, uneven, rc_off, rc_on = set(), False, False, False, False
    for i, seed in enumerate(SEEDS):
        ref_loss, ref_grads = _reference(kind, seed)
        ref_norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in ref_grads.values())))
        plan = out[0][i]["plan"]
        counts = {}  # micro-batches per shard block over the step
        for g in plan["groups"]:
            sp_seen.add(len(g["ranks"]))
            for r in g["ranks"]:
                counts[r // shard_size] = counts.get(r // shard_size, 0) + len(g["micro_batches"])
            for m in g["micro_batches"]:
                rc = m["layout"]["recompute"]
                rc_on |= rc["attn"] + rc["mlp"] > 0
                rc_off |= rc["attn"] + rc["mlp"] == 0
        idle_block |= 0 in counts.values()
        uneven |= len(set(counts.values())) > 1
        for r, res in enumerate(out):
            step = res[i]
            assert abs(step["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (kind, r, seed, step["loss"], ref_loss)
            assert set(step["grads"]) == set(ref_grads)
            for name, g in step["grads"].items():
                err = rel_err(g, ref_grads[name])
                worst = max(worst, err)
                assert err <= 1e-5, f"{kind} s={shard_size} rank {r} seed {seed} {name}: rel err {err:.2e} {plan}"
            # clip_grad_norm_: the global pre-clip norm, and torch's scaling
            assert abs(step["norm"] - ref_norm) <= 1e-5 * ref_norm, (r, seed, step["norm"], ref_norm)
            coef = step["max_norm"] / (ref_norm + 1e-6)
            for name, g in step["clipped"].items():
                assert rel_err(g, ref_grads[name] * coef) <= 1e-5, (r, seed, name)
    if shard_size == 2:
        assert sp_seen == {2, 4} and idle_block and uneven, (sp_seen, idle_block, uneven)
    else:
        assert sp_seen == {4}
    assert rc_on and rc_off
    print(f"{kind} shard_size={shard_size}: max rel err over ranks, steps and tensors {worst:.2e}")
    return worst


def test_dit_shard2_matches_single_process(workers):
    _check_parity(workers, "dit", 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,shard_size",
    [
        ("dit", 4),
        ("hf-llama", 2),
        ("hf-llama", 4),
        ("wan", 2),
        ("wan", 4),
        ("llama-tied", 2),
        ("dit-factorized", 2),
        ("hf-qwen3", 2),
    ],
)
def test_library_models_sharded_match_single_process(workers, kind, shard_size):
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    _check_parity(workers, kind, shard_size)


def test_sharded_adamw_steps_match_torch_and_the_unsharded_path(workers):
    kind, seed, n, steps = "dit", 5, 6, 2
    sharded = workers.run(sharded_cases.case_sharded_steps, kind, 2, seed, n, steps, False)
    plain = workers.run(sharded_cases.case_sharded_steps, kind, 1, seed, n, steps, False)
    for r in range(4):
        for name, p in plain[0]["params"].items():
            assert rel_err(sharded[r]["params"][name], p) <= 1e-5, (r, name)
    # a torch LR scheduler drives it: torch's AdamW with the same scheduler, single process
    scheduled = workers.run(sharded_cases.case_sharded_steps, kind, 2, seed, n, steps, True)
    model = support.make_model(kind)
    opt = support.reference_adamw(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(steps):
        support.reference(model, support.make_data(kind, n, seed + step), list(range(n)))
        opt.step()
        sched.step()
    assert scheduled[0]["lrs"] == [1e-2, 5e-3]
    for r in range(4):
        for name, p in model.named_parameters():
            assert rel_err(scheduled[r]["params"][name], p.detach()) <= 1e-5, (r, name)
        assert not all(torch.equal(scheduled[r]["params"][k], sharded[r]["params"][k]) for k in sharded[r]["params"])


def test_bad_shard_sizes_and_plans_splitting_a_block_are_refused(workers):
    out = workers.run(sharded_cases.case_refusals, "dit")
    for msgs in out:
        assert set(msgs) == {"shard_size=3", "shard_size=8", "plan", "StepPlan.check_shard_size", "unaligned"}, msgs
        assert "shard_size=3" in msgs["shard_size=3"] and "use one of [1, 2, 4]" in msgs["shard_size=3"]
        assert "(0,)" in msgs["plan"] and "whole blocks" in msgs["plan"]
        assert "(1, 2)" in msgs["unaligned"]


def test_parameter_and_gradient_storage_is_one_over_shard_size(workers):
    full = workers.run(sharded_cases.case_storage, 1)[0]
    for s in (2, 4):
        per_rank = workers.run(sharded_cases.case_storage, s)
        for b in per_rank:
            for k in ("params", "grads"):
                assert b[k] <= full[k] / s * 1.05, (s, k, b[k], full[k])


def test_bf16_model_keeps_fp32_shards_and_gradients(workers):
    """A bf16 model: fp32 sharded parameters (the master weights) and fp32 gradients, bf16
    compute; its loss is the fp32 reference's to bf16 precision (per-tensor gradient errors
    are bf16's, ~1e-2, and not checked here)."""
    out = workers.run(sharded_cases.case_bf16_step, 21, 5, 2)
    ref_loss, ref_grads = support.reference(support.make_model("dit"), support.make_data("dit", 5, 21), list(range(5)))
    for res in out:
        assert res["param_dtypes"] == ["torch.float32"] and res["grad_dtypes"] == ["torch.float32"]
        assert set(res["grads"]) == set(ref_grads)
        assert abs(res["loss"] - ref_loss) <= 1e-3 * abs(ref_loss), (res["loss"], ref_loss)
        assert rel_err(res["grads"]["final.weight"], ref_grads["final.weight"]) <= 5e-2


@pytest.fixture(scope="module")
def saved_runs(workers, tmp_path_factory):
    """``saved_runs(s)``: the checkpoint path and the uninterrupted run's parameters of
    `case_sharded_resume` at shard size ``s``, run once per shard size for the module (a
    resume only reads the checkpoint)."""
    runs: dict[int, tuple[str, list]] = {}

    def get(shard_size: int) -> tuple[str, list]:
        if shard_size not in runs:
            path = str(tmp_path_factory.mktemp(f"ck{shard_size}") / "ck")
            runs[shard_size] = path, workers.run(sharded_cases.case_sharded_resume, "dit", shard_size, path, True)
        return runs[shard_size]

    return get


@pytest.mark.parametrize("saved,loaded", [(2, 4), (4, 2), (2, 2)])
def test_sharded_checkpoint_resumes_at_another_shard_size(workers, saved_runs, saved, loaded):
    path, straight = saved_runs(saved)
    resumed = workers.run(sharded_cases.case_sharded_resume, "dit", loaded, path, False)
    for r in range(4):
        for name, p in straight[0].items():
            assert rel_err(resumed[r][name], p) <= 1e-5, (saved, loaded, r, name)


def test_sharded_checkpoint_resumes_at_another_world_size(saved_runs, tmp_path_factory):
    """Saved at world 4 with shard_size 2, resumed at world 2 with shard_size 2: other plans
    over the same samples, the same gradients to fp32 rounding."""
    path, straight = saved_runs(2)
    w2 = Workers(2, tmp_path_factory.mktemp("rdv2"))
    try:
        resumed = w2.run(sharded_cases.case_sharded_resume, "dit", 2, path, False)
    finally:
        w2.close()
    for r in range(2):
        for name, p in straight[0].items():
            assert rel_err(resumed[r][name], p) <= 1e-5, (r, name)


def test_loader_never_yields_a_plan_that_splits_a_block(workers):
    out = workers.run(sharded_cases.case_loader_shard_rule)
    assert all(o == out[0] for o in out), "the ranks disagree"
    if out[0]["error"] is not None:  # a planner that does not know the shard size: refused, not run
        assert "splits a parameter-shard block of shard_size=2" in out[0]["error"]
    else:
        assert out[0]["groups"] and not out[0]["split"]


@pytest.mark.parametrize("saved,loaded", [(1, 2), (2, 1)])
def test_checkpoints_of_either_shard_size_resume_at_the_other(workers, tmp_path, saved, loaded):
    """The one checkpoint format (torch.distributed.checkpoint) of a shard_size-1 run resumed
    with shard_size 2 (ZeroAdamW's ranges read into each parameter's pieces), and of a
    shard_size-2 run resumed with shard_size 1 (into ZeroAdamW's ranges): the second step's
    parameters equal the uninterrupted run's. Then a torn data file makes the checkpoint
    unreadable, said so."""
    from dcparallel import checkpoint

    root = str(tmp_path / "ck")
    straight = workers.run(sharded_cases.case_cross_format_resume, "dit", saved, root, True)
    ck = checkpoint.latest(root)
    assert (ck.version, ck.shard_size) == ((checkpoint.VERSION, 1) if saved == 1 else (checkpoint.VERSION_DCP, 2))
    resumed = workers.run(sharded_cases.case_cross_format_resume, "dit", loaded, root, False)
    for r in range(4):
        for name, p in straight[0].items():
            assert rel_err(resumed[r][name], p) <= 1e-5, (saved, loaded, r, name)
    if saved == 2:
        data = ck.path / "__1_0.distcp"
        data.write_bytes(data.read_bytes()[:-7])
        with pytest.raises(ValueError, match=r"__1_0.distcp has \d+ bytes, \d+ were committed \(torn write\?\)"):
            checkpoint.latest(root)


def test_a_per_rank_checkpoint_is_refused_then_converted_and_resumes_at_shard_size_2(workers, tmp_path):
    """A world-4 checkpoint in dcparallel 0.1's per-rank format (shard_size 1, written by a
    copy of the old writer) is refused with the command that converts it; converted in one
    process, it resumes with shard_size 2: the second step's parameters equal the
    uninterrupted run's."""
    from dcparallel import checkpoint
    from dcparallel.apps.checkpoint_convert import convert

    root = str(tmp_path / "ck")
    straight = workers.run(sharded_cases.case_cross_format_resume, "dit", 1, root, True, per_rank=True)
    with pytest.raises(ValueError, match=r"per-rank checkpoint format of dcparallel 0.1.*convert-checkpoint"):
        checkpoint.latest(root)
    assert convert(root, support.make_model("dit")) == ([1], [])
    ck = checkpoint.latest(root)
    assert (ck.version, ck.step, ck.world_size, ck.shard_size) == (checkpoint.VERSION, 1, 4, 1)
    resumed = workers.run(sharded_cases.case_cross_format_resume, "dit", 2, root, False)
    for r in range(4):
        for name, p in straight[0].items():
            assert rel_err(resumed[r][name], p) <= 1e-5, (r, name)


def test_checkpoint_metadata_is_read_without_running_code(tmp_path):
    import pickle

    from dcparallel.runtime.sharded_checkpoint import read_keys

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print, which is not part of torch.distributed"):
        read_keys(tmp_path)


@pytest.mark.parametrize("shard_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_prepare_profiles_with_sharding_on_and_plans_whole_blocks(workers, tmp_path, shard_size):
    """`prepare` on a transformers Llama (GQA) with shard blocks: the profiler measures with
    FSDP2 on (a skipped layer gathers nothing, so a deeper stack gathers more), only SP degrees
    of whole blocks, and records the sharded model states, which the cost model plans with;
    every plan of the epoch keeps the blocks whole; the first planned step's loss and full
    gradients equal a single process's over its samples; the epoch trains."""
    pytest.importorskip("transformers")
    from dcparallel.cost.base import gathered_bytes
    from dcparallel.spec import ModelSpec

    out = workers.run(sharded_profile_cases.case_prepare_sharded, shard_size, str(tmp_path / "profile.json"))
    p = out[0]["profile"]
    assert all(o["profile"] == p for o in out), "the ranks hold different profiles"
    assert p["shard_size"] == shard_size and p["fingerprint"]["shard_size"] == shard_size
    assert p["fingerprint"]["sp_sizes"] == [k for k in (2, 4) if k >= shard_size]
    assert {e["sp"] for e in p["entries"]} == set(p["fingerprint"]["sp_sizes"])
    assert any(e["feasible"] for e in p["entries"])
    # the sharded states: fp32 shards of parameters and gradients (1/s each), Adam moments over
    # the world, the gathered layer (CPU: not seen by the saved-tensor meter)
    n, spec = p["fingerprint"]["num_params"], ModelSpec(**p["model"])
    want = n * (4 + 4) / shard_size + 8 * n / 4 + gathered_bytes(spec)
    assert abs(p["model_state_bytes"] - want) <= 0.01 * want, (p["model_state_bytes"], want)
    # a small model in 1 GiB: the gradients are held whole between micro-batches, and planned for
    assert all(o["held"] and o["planned_state"] == p["model_state_bytes"] + 4 * n for o in out)
    # a skipped layer's hooks are suspended: two layers gather more than one (each layer's
    # forward and backward); with the skipped layer's FSDP hooks running both would gather alike
    g = out[0]["gathers"]
    assert g[2] >= g[1] + 2, g
    # the plans: whole blocks only, SP degrees of the profile
    plans = out[0]["plans"]
    assert plans and all(o["plans"] == plans for o in out) and out[0]["splits"] == []
    for plan in plans:
        for grp in plan["groups"]:
            if grp["micro_batches"]:
                assert len(grp["ranks"]) >= shard_size and grp["ranks"][0] % shard_size == 0, grp["ranks"]
    sample_ids = out[0]["first"]["sample_ids"]
    ref_loss, ref_grads = sharded_profile_cases.reference_first_step(sample_ids)
    worst = 0.0
    for r, o in enumerate(out):
        first = o["first"]
        assert first["sample_ids"] == sample_ids
        assert abs(first["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (r, first["loss"], ref_loss)
        assert set(first["grads"]) == set(ref_grads)
        for name, grad in first["grads"].items():
            err = rel_err(grad, ref_grads[name])
            worst = max(worst, err)
            assert err <= 1e-5, (r, name, err)
        assert len(o["losses"]) == len(plans) and all(math.isfinite(x) for x in o["losses"])
    print(f"prepare at shard_size={shard_size}: {len(plans)} steps, first step max rel err {worst:.2e}")


def test_auto_shard_size_is_the_smallest_that_fits_the_budget(workers):
    """``shard_size="auto"``: budgets between the model states at successive shard sizes pick
    1, 2 and 4, the same on every rank, logged with the reason; a budget below the states at
    the largest shard size is refused, naming the model size, the budget, the shard sizes tried
    and the fix."""
    states = sharded_profile_cases.deep_dit_states(4)
    assert states[1] > states[2] > states[4], states
    budgets = [
        int(1.01 * states[1]),
        int((states[1] + states[2]) / 2),
        int((states[2] + states[4]) / 2),
        int(0.9 * states[4]),
    ]
    out = workers.run(sharded_profile_cases.case_auto_shard_size, budgets)
    decided = [[(x.get("shard_size"), x.get("error")) for x in o] for o in out]
    assert all(d == decided[0] for d in decided), decided  # the same on every rank
    fits, two, four, none = out[0]
    assert fits["shard_size"] == 1 and fits["grads"] == "GradSync"
    assert fits["log"] and fits["log"][0].startswith("shard_size auto -> 1: model states")
    assert two["shard_size"] == 2 and two["grads"] == "ShardedGrads"
    assert two["log"][0].startswith("shard_size auto -> 2: model states need") and "at s=1" in two["log"][0]
    assert "over the memory budget" in two["log"][0]
    assert four["shard_size"] == 4 and "(" in four["log"][0] and "at s=2" in four["log"][0]
    assert all(not o[1]["log"] for o in out[1:])  # logged once (rank 0)
    # prepare checks the choice against the samples: one far too large is refused before profiling
    assert "shard_size='auto' chose 2 from the model states, but with these samples" in two["prepare_error"]
    assert "(64, 256, 256)" in two["prepare_error"]
    msg = none["error"]
    assert "shard_size='auto'" in msg and "parameters" in msg and "tried [1, 2, 4]" in msg
    assert "at shard size 4" in msg and "memory_bytes" in msg and "Use more GPUs" in msg


def test_auto_shard_size_with_ring_takes_groups_the_heads_do_not_divide(workers):
    """3 heads at world 4: without ring no SP group of 2 or 4 ranks divides them, so ``auto``
    tries shard size 1 only and a budget below its model states is refused, naming ring
    attention and the shard sizes it would allow; with ``ring=True`` the same budget takes
    shard size 2 (Ulysses x ring groups need not divide the heads)."""
    states = sharded_profile_cases.deep_dit_states(4, num_heads=3)
    budget = int((states[1] + states[2]) / 2)
    out = workers.run(sharded_profile_cases.case_auto_shard_size_ring, budget)
    assert all(o == out[0] for o in out), out  # the same on every rank
    without, with_ring = out[0][False], out[0][True]
    assert isinstance(without, str) and "tried [1]" in without, without
    assert "ring attention (ring=True" in without and "[2, 4] not tried" in without, without
    assert with_ring == 2


def test_gradients_held_whole_reduce_scatter_once_per_step(workers):
    """FSDP's gradient sync off until a block's last micro-batch: the gradients accumulate
    whole and each FSDP unit reduce-scatters once per step instead of once per micro-batch
    (counted both ways on the same plans), with the same loss and gradients (fp32 sums in
    another order: 1e-6); a step whose last micro-batch was announced as not the last is
    refused instead of losing the held gradients."""
    out = workers.run(sharded_cases.case_grad_hold, 2, [5, 6, 7], 8)
    multi = 0
    for per_rank in out:
        *steps, last = per_rank
        for res in steps:
            off, on, n = res[False], res[True], res["num_mbs"]
            assert off["reduce_scatters"] == n * on["reduce_scatters"], res
            assert (on["reduce_scatters"] > 0) == (n > 0)
            multi += n > 1
            assert abs(off["loss"] - on["loss"]) <= 1e-6 * abs(off["loss"])
            for name, g in off["grads"].items():
                assert rel_err(on["grads"][name], g) <= 1e-6, name
        assert (last["error"] is not None) == last["ran"], last
        if last["ran"]:
            assert "announced as not the last" in last["error"] and "last=True" in last["error"]
            assert "runs no further step" in last["error"]
    assert multi > 0  # some rank ran several micro-batches: the held path really held
