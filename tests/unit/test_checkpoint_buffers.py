"""Persistent buffers in the one checkpoint format (`runtime.sharded_checkpoint`), in one
process: a model whose forward updates its buffers (a step counter, an EMA of its output) is
killed and resumed from a checkpoint and ends exactly as an uninterrupted run; a checkpoint
without the model's buffers, and buffers that differ across ranks, are refused by name."""

from __future__ import annotations

import pytest
import torch

import dcparallel
from dcparallel import checkpoint
from dcparallel.apps import train_checkpoint
from dcparallel.data.synthetic import SyntheticText
from dcparallel.runtime import comm
from dcparallel.runtime import sharded_checkpoint as dcp_tensors
from tests.support import make_model

LENGTHS = [24, 40, 64, 100, 30, 52] * 4
STEPS = 6
PROFILE = None  # one CPU calibration for the module's runs (`profile_dir`)


@pytest.fixture(autouse=True, scope="module")
def profile_dir(tmp_path_factory):
    global PROFILE
    PROFILE = tmp_path_factory.mktemp("profile") / "p.json"


def _model(buffers: bool = True) -> torch.nn.Module:
    """The tiny Llama with two persistent buffers its forward updates: ``calls`` (an int64
    counter, 0-d) and ``ema`` (an EMA of the final norm's output, fp32)."""
    model = make_model("llama")
    if not buffers:
        return model
    model.register_buffer("calls", torch.zeros((), dtype=torch.int64))
    model.norm.register_buffer("ema", torch.zeros(model.norm.weight.shape))
    model.register_buffer("scratch", torch.ones(3), persistent=False)  # not in the state dict: not saved

    def update(module, args, out):
        with torch.no_grad():
            model.calls += 1
            module.ema.mul_(0.9).add_(out.detach().float().mean(dim=tuple(range(out.dim() - 1))), alpha=0.1)

    model.norm.register_forward_hook(update)
    return model


def _train(tmp_path, *, stop: int | None = None, resume: bool = False, buffers: bool = True):
    """Trains STEPS steps (``stop``: saves after that step and stops; ``resume``: starts from
    the newest checkpoint). Returns (losses, model, dc)."""
    model = _model(buffers)
    dc = dcparallel.DataCentricParallel(model, memory_bytes=2**30)
    loader = dc.prepare(
        SyntheticText(LENGTHS, vocab=64),
        lengths=LENGTHS,
        tokens_per_step=200,
        cost="analytic",
        profile_path=PROFILE,
    )
    opt = dc.optimizer(lr=1e-2)
    start = 0
    if resume:
        ck = checkpoint.latest(tmp_path / "ck")
        train_checkpoint.load(ck, dc, opt)
        start = ck.step
    losses = []
    for i, step in enumerate(loader):
        if i < start:
            continue
        for batch in step:
            with dc.micro_batch(batch) as ctx:
                ctx.backward(dc.loss_fn(model, batch, ctx))
        losses.append(dc.sync_gradients())
        opt.step()
        if i + 1 == stop:
            train_checkpoint.save(tmp_path / "ck", stop, dc, opt, {}, keep=2)
            break
        if i + 1 == STEPS:
            break
    return losses, model, dc


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_resumed_run_restores_the_buffers_its_forward_updates(tmp_path):
    ref_losses, ref, _ = _train(tmp_path / "ref")
    assert int(ref.calls) >= STEPS and ref.norm.ema.abs().sum() > 0  # the forward did update them
    first, _, _ = _train(tmp_path / "run", stop=2)
    saved = dcp_tensors.read_buffers(checkpoint.latest(tmp_path / "run" / "ck").path)
    assert sorted(saved) == ["calls", "norm.ema"] and saved["calls"].dtype == torch.int64  # not "scratch"
    rest, model, _ = _train(tmp_path / "run", resume=True)
    assert first + rest == ref_losses  # bit-identical, not approximately
    got, want = _state(model), _state(ref)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_checkpoint_without_the_models_buffers_is_refused_by_name(tmp_path):
    _train(tmp_path, stop=1, buffers=False)
    with pytest.raises(ValueError, match=r"missing: \['calls', 'norm.ema'\].*resume with the model the run"):
        _train(tmp_path, resume=True)


def test_buffers_that_differ_across_ranks_are_refused_when_saved(monkeypatch):
    """A rank whose buffer differs (as one updated from its own samples would): the save
    names the buffer and the fix (the other ranks' answers stood in)."""
    dc = dcparallel.DataCentricParallel(_model(), memory_bytes=2**30)
    monkeypatch.setattr(comm, "is_distributed", lambda: True)
    monkeypatch.setattr(comm, "world_rank", lambda: 0)
    monkeypatch.setattr(comm, "all_gather_object", lambda obj, group=comm.WORLD: [obj, {**obj, "norm.ema": "x"}])
    with pytest.raises(ValueError, match=r"persistent buffer 'norm.ema' differs across ranks .*ranks \[1\].*"):
        dcp_tensors._buffer_state(dc.engine, saving=True)
    monkeypatch.setattr(comm, "all_gather_object", lambda obj, group=comm.WORLD: [obj, dict(obj)])
    assert sorted(dcp_tensors._buffer_state(dc.engine, saving=True)) == ["buffer/calls", "buffer/norm.ema"]


def test_a_converted_per_rank_checkpoint_keeps_rank_0s_persistent_buffers():
    """dcparallel 0.1's rank-0 ``model`` state dict: its persistent buffers become
    ``buffer/<name>`` (a 0-d one with one dimension of 1); parameters and names the model
    does not hold as persistent buffers are left out."""
    from dcparallel.apps.checkpoint_convert import buffers

    model = _model()
    saved = {"calls": torch.tensor(7), "norm.ema": torch.full((32,), 0.5), "norm.weight": torch.ones(32)}
    out = buffers({**saved, "scratch": torch.zeros(3)}, model)
    assert sorted(out) == ["buffer/calls", "buffer/norm.ema"]
    assert out["buffer/calls"].tolist() == [7] and torch.equal(out["buffer/norm.ema"], saved["norm.ema"])
