"""Multi-process tests on gloo (world 2 and 4, workers spawned once per module; the random-plan
parity test at world 4).

Parity tolerance: every comparison is fp32 (fp64 for the attention kernel test) against a
single-process reference over the same samples. Sharding changes only the order of
floating-point sums (attention per head group, the loss and gradient sums over shards,
ranks and micro-batches, packed vs. separate documents), so differences are a few fp32
rounding errors (eps = 6e-8) per accumulated value: measured <= 6e-7 relative per tensor
(worst over both models, world 2 and 4), so 1e-5 leaves a 15x margin. A real bug (a lost
shard, a target counted twice, cross-document attention, a pad token in the loss, a wrong
rotary position) changes gradients by 1e-3 or more (a wrong rotary position: 2e-3)."""

from __future__ import annotations

import pytest
import torch

from tests.dist import cases
from tests.support import make_data, make_model, reference, reference_adamw, reference_once, rel_err

pytestmark = pytest.mark.dist

GRAD_RTOL = 1e-5


def test_groups_created_once_in_order_and_usable(workers):
    out = workers.run(cases.case_groups)
    w = workers.world
    expected = [(r,) for r in range(w)] + [(0, 1), (2, 3)][: w // 2] + ([(0, 1, 2, 3)] if w == 4 else [])
    for r, o in enumerate(out):
        assert list(o["blocks"]) == expected
        # each group really holds its ranks: the sum of (rank + 1) over the block
        for block, s in o["sums"].items():
            assert r in block and s == sum(x + 1 for x in block)
        assert o["singles_without_group"]  # one-rank blocks need no process group
        assert len(o["errors"]) == 3 and all("no process group was created" in e for e in o["errors"])
        assert o["seconds"] < 5.0


def test_gather_dict_and_check_equal(workers):
    out = workers.run(cases.case_comm)
    for o in out:
        assert o["gathered"] == {r: {"rank": r, "square": r * r} for r in range(workers.world)}
        assert "plan hash differs across ranks" in o["mismatch"]
        assert "ranks [0" in o["mismatch"] and "ranks [1" in o["mismatch"]


def test_control_group_is_one_gloo_group_with_its_own_timeout(workers):
    out = workers.run(cases.case_control_group, "7.5")
    for o in out:
        assert o["backend"] == "gloo" and o["same"] and o["timeout"] == 7.5
        assert o["gathered"] == [10 * r for r in range(workers.world)]


@pytest.mark.parametrize("pattern", ["causal", "full", "spatial", "temporal"])
def test_ulysses_equals_full_attention_forward_and_backward(workers, pattern):
    for seed in (0, 1):
        out = workers.run(cases.case_ulysses, pattern, seed)
        for per_rank in out:
            for sp, res in per_rank.items():
                # fp64: the only difference is the summation order of the kernel
                assert max(res["errors"]) < 1e-10, (sp, res)
                assert res["pad_max"] == 0.0, f"padding leaked into output/grad at sp={sp}: {res}"
        assert all(r["padded"] > r["seq_len"] for pr in out for sp, r in pr.items() if sp > 1)


def test_heads_not_divisible_by_sp_is_a_clear_error(workers):
    for msg in workers.run(cases.case_heads_error):
        assert "3 attention heads" in msg and "not divisible by 2" in msg


# world 4 only: its plans hold groups of SP 1, 2 and 4 (asserted below), so a world-2 plan
# (SP 1 and 2, the whole world at SP 2) runs no engine path these do not: the same hooks,
# Ulysses exchange and head split at SP 2 (a sub-group here), SP = the whole world, idle
# ranks, uneven counts, three phases
@pytest.mark.parametrize("workers", [4], ids=["world4"], indirect=True)
@pytest.mark.parametrize(
    "kind,backward_outside",
    [("llama", False), ("llama-tied", False), ("dit", False), ("dit-factorized", False), ("llama", True)],
    ids=["llama", "llama-tied", "dit", "dit-factorized", "llama-backward-after-block"],
)
def test_random_plans_match_single_process_gradients(workers, kind, backward_outside):
    """backward_outside: the recomputed forwards (inside backward) still run in the
    micro-batch's SP group with its documents after the `micro_batch` block exited."""
    seeds = [11, 12, 13, 14]
    num_samples = 9
    out = workers.run(cases.case_engine, kind, seeds, num_samples, backward_outside)
    sp_seen, idle_seen, rc_seen, uneven_counts, phased = set(), False, set(), False, False
    for i, seed in enumerate(seeds):
        data = make_data(kind, num_samples, seed)
        ref_loss, ref_grads = reference_once(
            ("runtime", kind, seed, num_samples), lambda: reference(make_model(kind), data, list(range(num_samples)))
        )
        plan = out[0][i]["plan"]
        uneven_counts |= len({len(g["micro_batches"]) for g in plan["groups"]}) > 1
        # ranks in three phases run narrow groups' micro-batches, then a wide group's, then narrow ones again
        busy = [(g["phase"], len(g["ranks"])) for g in plan["groups"] if g["micro_batches"]]
        phased |= (
            (1, workers.world) in busy
            and any(p == 0 and k < workers.world for p, k in busy)
            and any(p == 2 and k < workers.world for p, k in busy)
        )
        for g in plan["groups"]:
            sp_seen.add(len(g["ranks"]))
            idle_seen |= not g["micro_batches"]
            rc_seen |= {(m["layout"]["recompute"]["attn"], m["layout"]["recompute"]["mlp"]) for m in g["micro_batches"]}
        for r, res in enumerate(out):
            assert res[i]["plan"] == plan
            assert abs(res[i]["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (r, seed, res[i]["loss"], ref_loss)
            assert set(res[i]["grads"]) == set(ref_grads)
            for name, g in res[i]["grads"].items():
                err = rel_err(g, ref_grads[name])
                assert err <= GRAD_RTOL, f"rank {r} seed {seed} {name}: rel err {err:.2e} plan {plan}"
                # after the one all-reduce, every rank holds the very same gradient
                assert torch.equal(g, out[0][i]["grads"][name])
    # the random plans really covered what the test claims
    assert sp_seen == {1, 2, 4}, sp_seen
    assert idle_seen and uneven_counts and phased and len(rc_seen) >= 3


def test_packed_plan_with_sub_groups_matches_single_process_gradients(workers):
    """A plan `dcp`'s per-sample packing makes (`cases.packed_plan`): the long sample's group
    splits, so its ranks first run short samples in one-rank sub-groups (phase 0), then the
    long sample together (phase 1). Every rank plans it itself; loss and gradients match the
    single-process reference (tolerance: the module docstring)."""
    seed = 21
    out = workers.run(cases.case_packed, seed)
    plan = out[0]["plan"]
    busy = [(g["phase"], tuple(g["ranks"])) for g in plan["groups"] if g["micro_batches"]]
    wide = [r for p, r in busy if p == 1 and len(r) > 1]
    assert wide and any(p == 0 and set(r) < set(wide[0]) for p, r in busy), busy  # sub-groups, then their parent
    data = make_data("llama", len(plan["sample_ids"]), seed)
    ref_loss, ref_grads = reference(make_model("llama"), data, list(range(len(plan["sample_ids"]))))
    for r, res in enumerate(out):
        assert res["plan"] == plan  # planned independently on every rank
        assert abs(res["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (r, res["loss"], ref_loss)
        for name, g in res["grads"].items():
            assert rel_err(g, ref_grads[name]) <= GRAD_RTOL, (r, name)
            assert torch.equal(g, out[0]["grads"][name])


@pytest.mark.parametrize("use_zero", [True, False], ids=["zero1", "torch-adamw"])
def test_optimizer_steps_match_single_process_adamw(workers, use_zero):
    kind, seed, num_steps = "llama", 5, 2
    out = workers.run(cases.case_optimizer, kind, seed, use_zero, num_steps)
    model = make_model(kind)
    opt = reference_adamw(model)
    data = make_data(kind, 6, seed)
    for _ in range(num_steps):
        reference(model, data, list(range(6)))
        opt.step()
    for r, params in enumerate(out):
        for name, p in model.named_parameters():
            # Adam divides by sqrt(v): a relative gradient error e moves each update by ~e x lr
            assert rel_err(params[name], p.detach()) <= 1e-5, (r, name)
            assert torch.equal(params[name], out[0][name]), "parameters are not replicated"


def test_clipping_and_lr_schedule_match_single_process_torch(workers):
    """Pre-clip global norms and parameters after steps of scheduled, clipped ZeRO-1 AdamW
    equal torch.nn.utils.clip_grad_norm_ + AdamW + LambdaLR on the unmodified model."""
    seed, max_norm, num_steps = 4, 0.2, 3
    out = workers.run(cases.case_clip_schedule, seed, max_norm, num_steps)
    model = make_model("llama")
    opt = reference_adamw(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cases.clip_case_schedule)
    data = make_data("llama", 6, seed)
    norms = []
    for _ in range(num_steps):
        reference(model, data, list(range(6)))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        sched.step()
    assert all(n > max_norm for n in norms)  # every step really clips
    for r, res in enumerate(out):
        assert res["norms"] == pytest.approx(norms, rel=1e-5), r
        for name, p in model.named_parameters():
            assert rel_err(res["params"][name], p.detach()) <= 1e-5, (r, name)
            assert torch.equal(res["params"][name], out[0]["params"][name]), "parameters are not replicated"


def test_sp_group_ranks_draw_identical_noise(workers):
    a = workers.run(cases.case_noise, 0)
    b = workers.run(cases.case_noise, 1)
    r0, r1 = a[0], a[1]
    assert set(r0) == set(r1) and len(r0) >= 2
    for sid in r0:
        assert torch.equal(r0[sid][0], r1[sid][0])
        if r0[sid][1] is not None:
            assert torch.equal(r0[sid][1], r1[sid][1])
    sids = [s for s in r0 if s != 99]
    # not a constant: another sample, or another epoch, draws different noise
    if len(sids) > 1:
        assert not torch.equal(r0[sids[0]][1], r0[sids[1]][1])
    assert not torch.equal(r0[sids[0]][1], b[0][sids[0]][1])
