"""Gloo worker functions for models built on the meta device, sharded, then loaded from a
``save_pretrained`` folder (`runtime.meta_init`); module level, for spawn."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from dcparallel.runtime.engine import Engine
from dcparallel.runtime.meta_init import empty_init
from tests import support
from tests.dist import sharded_cases

HF_VOCAB = 512  # a vocabulary large enough that the embeddings are not the whole model


def build(kind: str, meta: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """``kind`` "hf-llama": a transformers Llama (8 query heads, 2 kv heads, 4 layers, rotary
    ``inv_freq`` buffers); "llama", "llama-tied": the reference LM (tied: one embedding
    matrix). On the meta device under `empty_init`, else on CPU with ``seed``."""
    ctx = empty_init() if meta else torch.random.fork_rng()
    with ctx:
        torch.manual_seed(seed)
        if kind in ("llama", "llama-tied"):
            return support.make_model(kind, seed).to(dtype)
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=HF_VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=dtype)


def save(kind: str, folder: str, dtype: torch.dtype, seed: int = 0) -> None:
    """The CPU model of ``kind`` written as a checkpoint folder (transformers: save_pretrained;
    the reference LM: its state_dict in model.safetensors, as `dcparallel export` writes it)."""
    model = build(kind, meta=False, dtype=dtype, seed=seed)
    if kind != "hf-llama":
        from safetensors.torch import save_model

        save_model(model, f"{folder}/model.safetensors")
    else:
        model.save_pretrained(folder)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live CPU tensor storage, each storage counted once, above what was live
    when it started: every tensor an operator takes or returns is remembered (weakly), and
    after every operator the storages still alive are summed. Tensors made outside the
    dispatcher (safetensors' slices) are seen when an operator reads them."""

    def __enter__(self):
        gc.collect()
        self.storages: dict[int, weakref.ref] = {}
        self.base = 0
        seen = set()
        for o in gc.get_objects():
            if issubclass(type(o), torch.Tensor) and not is_traceable_wrapper_subclass(o) and o.device.type == "cpu":
                s = o.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    self.base += s.nbytes()
        self.peak = 0
        return super().__enter__()

    def _remember(self, t) -> None:
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                self._remember(getattr(t, name))
        elif isinstance(t, torch.Tensor) and t.device.type == "cpu":
            s = t.untyped_storage()
            self.storages.setdefault(id(s), weakref.ref(s))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            self._remember(t)
        live = {}
        for k, ref in list(self.storages.items()):
            s = ref()
            if s is None:
                del self.storages[k]
            else:
                live[s.data_ptr()] = s.nbytes()
        self.peak = max(self.peak, sum(live.values()))
        return out


def case_wrap_and_load(kind: str, folder: str, dtype: str, meta: bool) -> dict:
    """Builds ``kind`` (on meta, or whole on CPU loaded from ``folder`` as a whole-model recipe
    would), wraps it with shard_size 2 and loads ``folder``; the peak live bytes of that
    (`LiveBytes`) and the bytes this rank's shards hold afterwards."""
    with LiveBytes() as tracker:
        model = build(kind, meta=meta, dtype=getattr(torch, dtype))
        dc = _wrap(kind, model)
        dc.load_weights(folder)
    gs = dc.grad_sync
    return {
        "peak": tracker.peak,
        "storage": gs.storage_bytes(),
        "param_dtypes": sorted({str(p.dtype) for p in dc.model.parameters()}),
    }


def _wrap(kind: str, model: torch.nn.Module) -> Engine:
    if kind != "hf-llama":
        return Engine(model, layers=model.layers, num_heads=support.NUM_HEADS, shard_size=2)
    return Engine(model, shard_size=2)


def case_meta_parity(kind: str, folder: str, seeds: list[int], num_samples: int) -> dict:
    """A meta model wrapped with shard_size 2 and loaded from ``folder``: its buffers, then per
    seed the loss and full gradients of a step over the whole world (SP 2, random recompute)."""
    dc = _wrap(kind, build(kind, meta=True))
    dc.load_weights(folder)
    buffers = {n: b.clone() for n, b in dc.model.named_buffers()}
    names = dict(dc.model.named_parameters(remove_duplicate=False))
    tied = sorted(n for n, p in names.items() if any(q is p and m != n for m, q in names.items()))
    steps = []
    for seed in seeds:
        data = sharded_cases._data(kind, num_samples, seed)
        plan = sharded_cases._plan(dc, kind, data, num_samples, seed, "world", True, 2)
        loss = sharded_cases._run_step(dc, kind, data, plan)
        steps.append({"loss": loss, "grads": dc.full_gradients()})
    assert dist.get_world_size() == 2
    return {"buffers": buffers, "steps": steps, "tied": tied}


def case_refusals(folder: str) -> dict:
    """Messages of the refusals: a meta model with shard_size 1, a model built under
    torch.device("meta") (its inv_freq lost), a micro-batch before load_weights, and a
    checkpoint of another config."""
    msgs = {}
    try:
        Engine(build("hf-llama", meta=True), shard_size=1)
    except ValueError as e:
        msgs["shard1"] = str(e)
    with torch.device("meta"):
        lost = build("hf-llama", meta=False)
    try:
        Engine(lost, shard_size=2)
    except ValueError as e:
        msgs["meta_buffers"] = str(e)
    dc = _wrap("hf-llama", build("hf-llama", meta=True))
    data = sharded_cases._data("hf-llama", 2, 0)
    plan = sharded_cases._plan(dc, "hf-llama", data, 2, 0, "world", False, 2)
    try:
        sharded_cases._run_step(dc, "hf-llama", data, plan)
    except ValueError as e:
        msgs["unloaded"] = str(e)
    ref = _wrap("llama", build("llama", meta=True))
    try:
        ref.load_weights(folder)
    except ValueError as e:
        msgs["mismatch"] = str(e)
    return msgs


def case_api_load(folder: str) -> dict:
    """`DataCentricParallel` given a meta transformers Llama with shard_size 2, then
    `load_weights`: the device it chose and every whole parameter (gathered)."""
    from dcparallel import DataCentricParallel

    dc = DataCentricParallel(build("hf-llama", meta=True), shard_size=2, memory_bytes=2**30)
    dc.load_weights(folder)
    return {
        "device": str(dc.params[0].device),
        "params": {n: p.full_tensor().detach().clone() for n, p in dc.model.named_parameters()},
    }
