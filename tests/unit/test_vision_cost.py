"""The vision tower in the cost model: a vision-language sample (`VisionSize`) is priced as
both towers, its images' patches through the vision tower's weights and attention, dealt over
the SP group image by image; the planner balances both; a profile, which measures the
language model only, refuses such a sample."""

import dataclasses
import pickle

import numpy as np
import pytest

from dcparallel.cost.analytic import AnalyticCost, fit_calibration
from dcparallel.cost.batch import Batches
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.cost.vision import class_rep
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import decoder_lm
from dcparallel.sim.replay import simulate, step_seconds
from dcparallel.spec import Recompute, VisionSize, VisionTower, Workload, batch_key, check_size, h200_cluster

from ._models import cluster
from .test_cost import _profile

#: Qwen2.5-VL-7B's shape: its language model and its 32-block vision tower (4 full-attention
#: blocks, the others in 8x8-patch windows)
LM = decoder_lm(
    "qwen2.5-7b",
    num_layers=28,
    hidden=3584,
    num_heads=28,
    num_kv_heads=4,
    ffn_hidden=18944,
    vocab_size=152064,
    qkv_bias=True,
)
TOWER = VisionTower(
    num_layers=32,
    hidden=1280,
    layer_params=4 * 1280 * 1280 + 3 * 1280 * 3420,
    full_layers=4,
    window=64,
    extra_params=45_000_000,
)
VLM = dataclasses.replace(LM, vision=TOWER)
DOC = 96 * 96  # patches of a 1344 x 1344 image (14-pixel patches)


def test_a_vision_size_is_its_tokens_and_keeps_its_patches():
    s = VisionSize(2400, (DOC,))
    assert int(s) == 2400 and s.patches == (DOC,) and VLM.tokens(s) == 2400
    assert s != 2400 and s != VisionSize(2400, (DOC, 1)) and s == VisionSize(2400, (DOC,))
    assert len({s, VisionSize(2400, (DOC,)), 2400}) == 2
    assert pickle.loads(pickle.dumps(s)) == s and check_size(s) is s
    assert Workload(VLM, (s, 100)).tokens == (2400, 100)
    with pytest.raises(ValueError, match="positive integer patch count"):
        VisionSize(10, (0,))


def test_an_image_costs_the_vision_towers_share_more_than_text_of_as_many_tokens():
    c = AnalyticCost(VLM, h200_cluster(64))
    text, doc = c.terms([2400], 1), c.terms([VisionSize(2400, (DOC,))], 1)
    cal = fit_calibration("llama-7b")
    ref = cal.ref.attn_params + cal.ref.mlp_params + cal.ref.other_params
    lin = cal.lin_s_per_token * TOWER.num_layers * TOWER.layer_params / ref * DOC
    attn = cal.attn_s_per_pair * TOWER.hidden / cal.ref.hidden * TOWER.pairs(DOC)
    assert TOWER.pairs(DOC) == 4 * DOC * DOC + 28 * DOC * 64
    assert doc.time_none - text.time_none == pytest.approx(lin + attn, rel=1e-12)
    # the linear part is the towers' FLOPs ratio: patches x tower weights over tokens x LM layer weights
    lm_lin = cal.lin_s_per_token * (LM.attn_params + LM.mlp_params + LM.other_params) / ref * 2400 * LM.num_layers
    flops = (
        DOC
        * TOWER.num_layers
        * TOWER.layer_params
        / (2400 * LM.num_layers * (LM.attn_params + LM.mlp_params + LM.other_params))
    )
    assert lin / lm_lin == pytest.approx(flops, rel=1e-12) and 0.25 < flops < 0.4
    assert doc.fixed_bytes > text.fixed_bytes  # its activations, kept for the tower's backward
    # the language model's part is the same: recomputing its layers saves what it saved before
    assert (doc.dt_attn, doc.save_full, doc.act_layer) == (text.dt_attn, text.save_full, text.act_layer)
    # the model's state holds the tower's weights too
    assert VLM.num_params == LM.num_params + TOWER.num_params
    assert c.model_state_bytes() > AnalyticCost(LM, h200_cluster(64)).model_state_bytes()


def test_a_frozen_tower_runs_forward_only_and_keeps_nothing():
    cl = h200_cluster(64)
    frozen = dataclasses.replace(VLM, vision=dataclasses.replace(TOWER, trainable=False))
    base = AnalyticCost(VLM, cl).terms([2400], 1)
    t = AnalyticCost(VLM, cl).terms([VisionSize(2400, (DOC,))], 1).time_none - base.time_none
    f = AnalyticCost(frozen, cl).terms([VisionSize(2400, (DOC,))], 1)
    assert f.time_none - AnalyticCost(frozen, cl).terms([2400], 1).time_none == pytest.approx(t / 3, rel=1e-12)
    assert f.fixed_bytes == AnalyticCost(frozen, cl).terms([2400], 1).fixed_bytes


def test_the_sp_group_shares_images_whole():
    c = AnalyticCost(VLM, h200_cluster(64))

    def tower(sizes, sp):
        return c.terms(sizes, sp).time_none - c.terms([int(s) for s in sizes], sp).time_none

    four = [VisionSize(700, (1024,) * 4)]
    assert tower(four, 4) == pytest.approx(tower(four, 1) / 4, rel=1e-12)  # one image per rank
    one = [VisionSize(2400, (DOC,))]
    assert tower(one, 4) == pytest.approx(tower(one, 1), rel=1e-12)  # one image: one rank encodes it all
    mixed = [VisionSize(2400, (DOC,)), VisionSize(300, (256,))]
    assert tower(mixed, 2) == pytest.approx(tower(one, 1), rel=1e-12)  # the big one bounds the group


def test_many_micro_batches_at_once_match_one_at_a_time_bit_for_bit():
    c = AnalyticCost(VLM, h200_cluster(64))
    batches = [
        [VisionSize(2400, (DOC,)), 300],
        [VisionSize(500, (256, 64)), 100, 7],
        [900],
        [VisionSize(9000, (30 * 1024,))],
    ]
    grid = c.terms_grid(Batches.of(VLM, batches), [1, 2, 4, 8])
    for i, b in enumerate(batches):
        for j, sp in enumerate([1, 2, 4, 8]):
            t = c.terms(b, sp)
            for f in dataclasses.fields(t):
                if f.name not in ("num_layers", "keep_all_feasible"):
                    assert getattr(t, f.name) == getattr(grid, f.name)[i, j], (i, sp, f.name)


def test_the_planner_balances_both_towers():
    """Equal token counts, half with a document image: a plan made blind to the tower (the
    same lengths as plain tokens) runs slower, priced with it, than one made seeing it."""
    rng = np.random.default_rng(0)
    sizes = [VisionSize(2400, (DOC,)) if rng.random() < 0.5 else 2400 for _ in range(512)]
    cl = h200_cluster(16)
    seeing = PlanContext(Workload(VLM, tuple(sizes)), AnalyticCost(VLM, cl), cl)
    blind = PlanContext(Workload(LM, tuple(int(s) for s in sizes)), AnalyticCost(LM, cl), cl)
    steps = form_steps(seeing.tokens, seed=0, tokens_per_step=16 * 2400 * 8)[:2]
    plans = {
        name: [make_planner("dcp", ctx, steps, score=step_seconds(ctx)).plan(s) for s in steps]
        for name, ctx in (("seeing", seeing), ("blind", blind))
    }
    t_seeing = simulate(plans["seeing"], seeing).total_time
    t_blind = simulate(plans["blind"], seeing).total_time
    assert t_seeing < t_blind * 0.98, (t_seeing, t_blind)


def test_vision_samples_of_equal_tokens_but_far_apart_patches_are_not_batched_alike():
    key = [
        batch_key(VLM, s)
        for s in (
            VisionSize(2400, (DOC,)),
            VisionSize(2400, (256,)),
            2400,
            VisionSize(2400, (DOC // 2, DOC // 2)),
            VisionSize(2450, (DOC + 100,)),
        )
    ]
    assert len({key[0], key[1], key[2], key[3]}) == 4 and key[4] == key[0]
    assert batch_key(LM, 2400) == key[2]


def test_a_class_is_sized_by_a_size_no_member_exceeds():
    members = [VisionSize(5881, (5808, 6512, 5544)), VisionSize(5647, (6720, 6364, 4640)), VisionSize(5700, (9000,))]
    rep = class_rep(members, [int(s) for s in members])
    assert rep == VisionSize(5881, (9000, 6364, 5544))
    c = AnalyticCost(VLM, h200_cluster(64))
    for sp in (1, 2, 4):
        for n in (1, 2, 3):
            big = c.terms_copies(rep, n, sp)
            for s in members:
                t = c.terms_copies(s, n, sp)
                assert t.time_none <= big.time_none and t.memory(Recompute(0, 0)) <= big.memory(Recompute(0, 0))
    assert class_rep([300, 500, 500, 20], [300, 500, 500, 20]) == 500  # text: the longest member


def test_a_profile_refuses_a_vision_sample():
    c = ProfiledCost(Profile.from_json(_profile()), cluster(2, 2))
    c.terms([1000], 2)
    for call in (lambda: c.terms([VisionSize(1000, (64,))], 2), lambda: c.terms_copies(VisionSize(1000, (64,)), 2, 2)):
        with pytest.raises(ValueError, match="not a vision tower"):
            call()
