"""`ZeroAdamW` as a `torch.optim.Optimizer` (param_groups driven by torch's LR schedulers,
state_dict round trip) and `Engine.clip_grad_norm_` against `torch.nn.utils.clip_grad_norm_`
on the unmodified model in one process (world 1; world 2 and 4: tests/dist/test_dist_runtime.py)."""

from __future__ import annotations

import importlib
import inspect
import math
import subprocess
import sys

import pytest
import torch

from dcparallel.runtime.engine import Engine
from dcparallel.runtime.zero import ZeroAdamW
from tests.support import (
    NUM_HEADS,
    make_data,
    make_model,
    random_plan,
    reference,
    reference_adamw,
    rel_err,
    run_rank_step,
)

torch.set_num_threads(1)


def _engine() -> Engine:
    m = make_model("llama")
    return Engine(m, layers=m.layers, num_heads=NUM_HEADS)


FRESH_ENGINE_OPTIMIZER = """
import sys
import torch
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.runtime.engine import Engine
m = Llama(LlamaConfig.tiny(num_layers=2, num_heads=4, hidden=32, ffn_hidden=48, vocab_size=64))
opt = Engine(m, layers=m.layers, num_heads=4).optimizer(lr=1e-2, weight_decay=0.1)
assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
print("torch._dynamo" in sys.modules)
"""


def test_zero_adamw_skips_the_compiler_import_until_something_compiles(monkeypatch):
    """torch's `Optimizer.add_param_group` imports torch._dynamo on its first call (about 1
    processor second of every rank's start, `compat.unless_compiling`): in a fresh
    interpreter an engine and its `ZeroAdamW` leave torch._dynamo unimported; once it is
    imported, the optimizer calls the method through torch's wrapper."""
    fresh = subprocess.run([sys.executable, "-c", FRESH_ENGINE_OPTIMIZER], capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.split() == ["False"]

    importlib.import_module("torch._dynamo")

    def through_the_wrapper(*args, **kwargs):
        raise AssertionError("called through torch's _disable_dynamo wrapper")

    # the wrapper calls what it cached on the function at its first call
    original = inspect.unwrap(torch.optim.Optimizer.add_param_group)
    monkeypatch.setattr(original, "__dynamo_disable", through_the_wrapper, raising=False)
    with pytest.raises(AssertionError, match="_disable_dynamo wrapper"):
        _engine().optimizer(lr=1e-2)


def _warmup_cosine(step: int) -> float:
    return (step + 1) / 3 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 4))


def test_zero_adamw_is_a_torch_optimizer_that_schedulers_drive():
    dc = _engine()
    opt = dc.optimizer(lr=1e-2, weight_decay=0.1)
    assert isinstance(opt, torch.optim.Optimizer) and len(opt.param_groups) == 1
    assert opt.param_groups[0]["params"] == dc.params
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)
    ref = make_model("llama")
    ref_opt = reference_adamw(ref)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _warmup_cosine)
    data = make_data("llama", 4, seed=3)
    lrs = []
    for step in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        run_rank_step(dc, data, random_plan(data, [0, 1, 2, 3], 1, step, len(dc.layers)), 0)
        reference(ref, data, [0, 1, 2, 3])
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert lrs == pytest.approx([1e-2 * _warmup_cosine(s) for s in range(4)], rel=1e-12)
    for (name, p), q in zip(dc.model.named_parameters(), ref.parameters(), strict=True):
        assert rel_err(p.detach(), q.detach()) <= 1e-5, name  # so the scheduled lr is the one used

    # a step at lr 0 changes nothing: the lr is read from param_groups at every step
    opt.param_groups[0]["lr"] = 0.0
    before = dc.flat_param.clone()
    run_rank_step(dc, data, random_plan(data, [0, 1], 1, 9, len(dc.layers)), 0)
    opt.step()
    assert torch.equal(dc.flat_param, before)
    with pytest.raises(ValueError, match="one parameter group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_zero_adamw_state_dict_round_trip_keeps_hyperparameters_and_moments():
    dc = _engine()
    opt = dc.optimizer(lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)
    data = make_data("llama", 3, seed=1)
    run_rank_step(dc, data, random_plan(data, [0, 1, 2], 1, 0, len(dc.layers)), 0)
    opt.step()
    sched.step()
    state = opt.state_dict()
    assert state["hparams"]["lr"] == pytest.approx(1e-2 * _warmup_cosine(1)) and state["hparams"]["initial_lr"] == 1e-2

    dc2 = _engine()
    opt2 = dc2.optimizer(lr=5.0)
    opt2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == state["hparams"]["lr"] and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    assert opt2.num_steps == 1 and torch.equal(opt2.exp_avg_sq, opt.exp_avg_sq)
    assert torch.equal(dc2.flat_param, dc.flat_param)


def _reference_clipped(max_norm: float, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = make_model("llama")
    data = make_data("llama", 4, seed=seed)
    reference(model, data, [0, 1, 2, 3])
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    return norm, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "below-max"])
def test_clip_grad_norm_equals_torch_on_the_unmodified_model(max_norm):
    dc = _engine()
    data = make_data("llama", 4, seed=7)
    run_rank_step(dc, data, random_plan(data, [0, 1, 2, 3], 1, 0, len(dc.layers)), 0)
    norm = dc.clip_grad_norm_(max_norm)
    ref_norm, ref_grads = _reference_clipped(max_norm, seed=7)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert (norm > max_norm) == (max_norm == 0.05)  # the case really clips (or really does not)
    for name, p in dc.model.named_parameters():
        assert rel_err(p.grad, ref_grads[name]) <= 1e-5, name
    if max_norm < 1:
        clipped = torch.linalg.vector_norm(dc.flat_grad[: dc.numel])
        assert float(clipped) == pytest.approx(max_norm, rel=1e-4)


def test_clip_grad_norm_needs_synced_grads_and_follows_torch_on_non_finite():
    dc = _engine()
    with pytest.raises(RuntimeError, match="sync_gradients"):
        dc.clip_grad_norm_(1.0)
    data = make_data("llama", 2, seed=0)
    run_rank_step(dc, data, random_plan(data, [0, 1], 1, 0, len(dc.layers)), 0)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        dc.clip_grad_norm_(0.0)
    dc.params[0].grad.view(-1)[0] = float("nan")
    ref = [torch.nn.Parameter(p.detach().clone()) for p in dc.params]
    for q, p in zip(ref, dc.params, strict=True):
        q.grad = p.grad.clone()
    norm = dc.clip_grad_norm_(1.0)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    assert math.isnan(norm) and math.isnan(ref_norm)
    for p, q in zip(dc.params, ref, strict=True):  # scaled by nan, as torch scales
        assert torch.equal(torch.isnan(p.grad), torch.isnan(q.grad)) and torch.isnan(p.grad).all()


def test_clip_grad_norm_refreshes_low_precision_grads_of_a_foreign_optimizer():
    """Without the engine's optimizer a bf16 parameter's p.grad is a copy of its fp32
    gradient (for torch optimizers, which read p.grad); clipping refreshes the copy."""
    m = make_model("llama").to(torch.bfloat16)
    dc = Engine(m, layers=m.layers, num_heads=NUM_HEADS)
    data = make_data("llama", 2, seed=0)
    run_rank_step(dc, data, random_plan(data, [0, 1], 1, 0, len(dc.layers)), 0)
    dc.clip_grad_norm_(1e-3)
    for p, view in zip(dc.params, dc.grad_sync.views, strict=True):
        assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, view.to(torch.bfloat16))


def test_zero_adamw_leaves_no_low_precision_grad_copies():
    """With ZeroAdamW a bf16 parameter holds no p.grad (2 bytes a parameter the memory recipe
    does not count); `gradients` gives the clipped fp32 gradients, views of the buffer."""
    m = make_model("llama").to(torch.bfloat16)
    dc = Engine(m, layers=m.layers, num_heads=NUM_HEADS)
    opt = dc.optimizer(lr=1e-2)
    assert isinstance(opt, ZeroAdamW)
    data = make_data("llama", 2, seed=0)
    run_rank_step(dc, data, random_plan(data, [0, 1], 1, 0, len(dc.layers)), 0)
    norm = dc.clip_grad_norm_(1e-3)
    assert norm > 1e-3 and all(p.grad is None for p in dc.params)
    grads = dc.gradients()
    assert list(grads) == [n for n, _ in m.named_parameters()]
    for g, view in zip(grads.values(), dc.grad_sync.views, strict=True):
        assert g.dtype == torch.float32 and g.data_ptr() == view.data_ptr()
    clipped = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-4)
    full = dc.full_gradients()
    assert all(torch.equal(full[n], g) and full[n].data_ptr() != g.data_ptr() for n, g in grads.items())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_cosine_annealing_sets_the_same_lrs_as_on_torch_adamw():
    dc = _engine()
    opt = dc.optimizer(lr=1e-2)
    ref = torch.optim.AdamW(make_model("llama").parameters(), lr=1e-2)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=1e-4) for o in (opt, ref)]
    seen = []
    for _ in range(7):
        seen.append((opt.param_groups[0]["lr"], ref.param_groups[0]["lr"]))
        for s in scheds:
            s.step()
    assert [a for a, _ in seen] == [b for _, b in seen] and len({a for a, _ in seen}) > 4


def test_zero1_all_gather_writes_into_the_flat_buffer_in_place(monkeypatch):
    """The post-step all-gather is one `compat.all_gather_into_tensor` whose output is the flat buffer
    itself and whose input is this rank's slice of it: the in-place form NCCL runs without a
    full-size temporary (fake process group, rank 1 of 4)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dcparallel.runtime import comm, compat

    calls = []
    monkeypatch.setattr(compat, "all_gather_into_tensor", lambda out, inp, group=None: calls.append((out, inp)))
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        flat = torch.zeros(20, dtype=torch.bfloat16)
        assert comm.all_gather_shards_(flat, 5) is flat
    finally:
        dist.destroy_process_group()
    [(out, inp)] = calls
    assert out.data_ptr() == flat.data_ptr() and out.numel() == 20
    assert inp.data_ptr() == flat[5:10].data_ptr() and inp.numel() == 5
