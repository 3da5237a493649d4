"""No host synchronization inside a step: a micro-batch's forward and loss (noise drawing
included) on an accelerator create no host tensor and read nothing back from the device.

The accelerator is played by the "meta" device (tensors with shapes and no data: a read of a
value fails there, as it would block on CUDA); the model and the batch are moved there as the
loader moves them, the text models in bf16 through dcparallel's CUDA kernel choice
(varlen_attn, stubbed). A dispatch mode records every op whose output is a host tensor (a
host tensor built mid-step is copied to the device, a pageable copy that blocks) and every
read of a device value (`.item()`, `.tolist()`). The per-sample generator is a host one here
(no CUDA generator on a CPU build); it draws straight onto the device, as a CUDA generator
does."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dcparallel.models.attention as attention
import dcparallel.runtime.engine as engine
from dcparallel.data.collate import resolve_collate
from dcparallel.plan.types import MicroBatch
from dcparallel.spec import Layout


class HostRecorder(TorchDispatchMode):
    """Records the ops that produce a host tensor or read a device value to the host."""

    def __init__(self):
        super().__init__()
        self.host: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host.append(f"{func} (a device value read by the host)")
        elif any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_leaves(out)):
            self.host.append(str(func))
        return out


class HostDataRecorder(TorchFunctionMode):
    """Records tensors built from host data (`torch.tensor` of a list: copied to the device
    inside the call, where no dispatch mode sees it) and reads of device values."""

    CALLS = (
        torch.tensor,
        torch.as_tensor,
        torch.asarray,
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
    )

    def __init__(self):
        super().__init__()
        self.host: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.CALLS:
            self.host.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _reference_llama():
    from dcparallel.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=96, hidden=32, num_layers=2, num_heads=4, ffn_hidden=64)), "text"


def _hf_llama():
    pytest.importorskip("transformers")
    from tests.adapter_models import build

    return build("hf-llama"), "text"


def _dit():
    from dcparallel.models.dit import DiT, DiTConfig

    return DiT(DiTConfig(num_layers=2, num_heads=4, hidden=32, freq_dim=16, attention="full")), "video"


def _wan():
    pytest.importorskip("diffusers")
    from tests.adapter_models import build

    return build("wan"), "wan"


def _samples(kind: str, model):
    if kind == "wan":
        from tests.adapter_models import item, make_data

        data = make_data("wan", 2, 3)
        return {i: item(data, i) for i in range(2)}
    if kind == "text":
        return {i: torch.randint(0, 96, (n,)) for i, n in enumerate((11, 6))}
    from dcparallel.adapters.reference import dit_samples

    return {i: dit_samples(model)((17, 32, 48), i) for i in range(2)}


@pytest.mark.parametrize(
    "build", [_reference_llama, _hf_llama, _dit, _wan], ids=["reference-llama", "hf-llama", "dit", "diffusers-wan"]
)
def test_a_micro_batch_on_cuda_creates_no_host_tensor_and_reads_nothing_back(monkeypatch, build):
    model, kind = build()
    samples = _samples(kind, model)
    boundaries = []
    if kind == "text":  # bf16 packed text takes varlen_attn on CUDA
        model.to(torch.bfloat16)
        monkeypatch.setattr(attention, "_device_type", lambda q: "cuda")
        monkeypatch.setattr(attention, "_torch_version", lambda: (2, 13))

        def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
            boundaries.append(cu_q)
            return q.new_empty(q.shape)

        monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen)
    # meta plays the accelerator here, not a model waiting for `load_weights`
    monkeypatch.setattr(engine, "on_meta", lambda m: False)
    dc = engine.Engine(model.to("meta"), kernel=attention.cuda_varlen_attention)
    collate = resolve_collate(dc.adapter.collate, "text" if kind == "text" else "video")
    sids = (0, 1) if kind != "wan" else (0,)  # the two Wan samples differ in shape
    batch = collate(samples, MicroBatch(sids, Layout(1, len(sids))), (0,), 0)
    monkeypatch.setattr(
        engine, "device_generator", lambda device, seed: torch.Generator().manual_seed(seed), raising=False
    )
    batch = batch.to("meta", non_blocking=True)
    with dc.micro_batch(batch) as ctx, HostRecorder() as rec, HostDataRecorder() as data:
        loss = dc.adapter.loss_fn(model, batch, ctx)
        if kind == "text":
            assert batch.sample_mean_weights().device.type == "meta"
    assert loss.device.type == "meta"
    assert rec.host == [] and data.host == []
    # the kernel reads the boundaries the batch brought along, in each of the 2 layers
    own = getattr(batch, "cu_seqlens_tensor", None)
    assert len(boundaries) == (2 if kind == "text" else 0) and all(b is own for b in boundaries)
