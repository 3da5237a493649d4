"""`dc.optimizer(params_or_groups, ...)` against torch.optim.AdamW on the unmodified model in
one process (world 1): parameter groups with their own lr and weight decay, a scheduler over
them, a parameter in no group left alone, torch's defaults, and the refusals."""

from __future__ import annotations

import inspect

import pytest
import torch

import dcparallel
from tests.support import make_data, make_model, random_plan, reference, rel_err, run_rank_step

torch.set_num_threads(1)


def _split(model: torch.nn.Module) -> tuple[list, list, list]:
    """Matrices but the embedding, vectors (norms), the embedding: three kinds of groups."""
    named = list(model.named_parameters())
    emb = [p for n, p in named if "emb" in n]
    mats = [p for n, p in named if p.dim() >= 2 and "emb" not in n]
    vecs = [p for n, p in named if p.dim() < 2]
    assert emb and mats and vecs
    return mats, vecs, emb


def _groups(model, with_embedding: bool) -> list[dict]:
    mats, vecs, emb = _split(model)
    groups = [{"params": mats, "weight_decay": 0.1}, {"params": vecs, "lr": 3e-3, "weight_decay": 0.0}]
    return groups + ([{"params": emb, "lr": 2e-2, "betas": (0.8, 0.99)}] if with_embedding else [])


@pytest.mark.parametrize("with_embedding", [True, False], ids=["all-params", "embedding-left-out"])
def test_groups_update_as_torch_adamw_with_the_same_groups(with_embedding):
    dc = dcparallel.DataCentricParallel(make_model("llama"))
    opt = dc.optimizer(_groups(dc.model, with_embedding), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref = make_model("llama")
    ref_opt = torch.optim.AdamW(_groups(ref, with_embedding), lr=1e-2)  # torch's defaults otherwise
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    emb_before = [p.detach().clone() for p in _split(dc.model)[2]]
    data = make_data("llama", 4, seed=5)
    for step in range(3):
        run_rank_step(dc.engine, data, random_plan(data, [0, 1, 2, 3], 1, step, len(dc.layers)), 0)
        reference(ref, data, [0, 1, 2, 3])
        # the same gradients on both sides: Adam divides by sqrt(v), so a gradient's last-bit
        # differences (the plan sums micro-batches in another order; gradient parity is tested
        # elsewhere) would grow with each step, and this test is about the groups
        for p, q in zip(dc.model.parameters(), ref.parameters(), strict=True):
            assert rel_err(p.grad, q.grad) <= 1e-5
            q.grad.copy_(p.grad)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups], rel=1e-12)
    for (name, p), q in zip(dc.model.named_parameters(), ref.parameters(), strict=True):
        assert rel_err(p.detach(), q.detach()) <= 1e-6, name
    if not with_embedding:  # in no group: not updated, as torch leaves it
        assert all(torch.equal(p, q) for p, q in zip(_split(dc.model)[2], emb_before, strict=True))


def test_defaults_are_torch_adamw_defaults():
    ours = inspect.signature(dcparallel.DataCentricParallel.optimizer).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    for name in ("lr", "betas", "eps", "weight_decay"):
        assert ours[name].default == theirs[name].default, name
    dc = dcparallel.DataCentricParallel(make_model("llama"))
    opt = dc.optimizer(dc.model.parameters())  # plain parameters: one group, torch's defaults
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 1e-2


def test_group_state_round_trips_with_every_groups_settings():
    dc = dcparallel.DataCentricParallel(make_model("llama"))
    opt = dc.optimizer(_groups(dc.model, True), lr=1e-2)
    opt.param_groups[2]["lr"] = 7e-3
    state = opt.state_dict()
    dc2 = dcparallel.DataCentricParallel(make_model("llama"))
    opt2 = dc2.optimizer(_groups(dc2.model, True), lr=1.0)
    opt2.load_state_dict(state)
    assert [g["lr"] for g in opt2.param_groups] == [1e-2, 3e-3, 7e-3]
    assert opt2.param_groups[2]["betas"] == (0.8, 0.99)


def test_refused_groups_name_the_fix():
    dc = dcparallel.DataCentricParallel(make_model("llama"))
    mats, vecs, _ = _split(dc.model)
    with pytest.raises(ValueError, match="in groups 0 and 1"):
        dc.optimizer([{"params": mats}, {"params": mats[:1]}])
    with pytest.raises(ValueError, match="not trainable parameters of the wrapped model"):
        dc.optimizer([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"keys \['momentum'\]"):
        dc.optimizer([{"params": vecs, "momentum": 0.9}])
    with pytest.raises(ValueError, match="empty parameter list"):
        dc.optimizer([])
