"""Gloo worker functions for the LoRA / frozen-parameter tests (module level, for spawn)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dcparallel.runtime.engine import Engine
from tests import adapter_models, lora_models, support
from tests.dist.cases_common import adapter_step

MODES = ("phases", "random", "idle", "world")


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (a DTensor shard's gathered: collective)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def case_lora_parity(kind: str, shard_size: int, seeds: list[int], num_samples: int, recompute: list[bool]) -> dict:
    """One engine on ``kind`` with ``shard_size``; a step per seed on a random plan of whole
    shard blocks (modes in `MODES` order; recompute random or off): its loss, the trainable
    parameters' whole gradients, the plan. Then one AdamW step: whether every frozen parameter
    is bit for bit what it was, and the smallest change of a trainable one."""
    model = lora_models.build(kind)
    base = lora_models.BASE[kind]
    dc = Engine(model, shard_size=shard_size)
    frozen = {n: _whole(p) for n, p in model.named_parameters() if not p.requires_grad}
    steps = []
    for i, seed in enumerate(seeds):
        data = adapter_models.make_data(base, num_samples, seed)
        plan = support.random_plan(
            data,
            list(range(num_samples)),
            dist.get_world_size(),
            seed,
            num_layers=dc.adapter.spec.num_layers,
            mode=MODES[i % len(MODES)],
            min_size=shard_size,
        )
        plan = plan if recompute[i] else support.capped(plan, 0)
        loss = adapter_step(dc, plan, data, adapter_models.item)
        steps.append({"loss": loss, "grads": dc.full_gradients(), "plan": plan.to_json()})
    before = {n: _whole(p) for n, p in model.named_parameters() if p.requires_grad}
    dc.optimizer(lr=1e-2, weight_decay=0.1).step()
    after = {n: _whole(p) for n, p in model.named_parameters()}
    return {
        "steps": steps,
        "frozen": sorted(frozen),
        "frozen_unchanged": all(torch.equal(after[n], v) for n, v in frozen.items()),
        "min_trained_change": min(float((after[n] - v).abs().max()) for n, v in before.items()),
        "attention_verified": dc.attention_verified,
    }


def case_mixed_dtype_step(kind: str, shard_size: int, seed: int, num_samples: int) -> dict:
    """A bf16 frozen base under fp32 adapters: one step (a plan of whole blocks) and one AdamW
    step. The loss, the trainable gradients (fp32), whether the frozen parameters kept their
    dtype and bits, and the dtypes of the trainable parameters."""
    model = lora_models.build(kind, base_dtype=torch.bfloat16)
    dc = Engine(model, shard_size=shard_size)
    frozen = {n: _whole(p) for n, p in model.named_parameters() if not p.requires_grad}
    data = adapter_models.make_data(lora_models.BASE[kind], num_samples, seed)
    plan = support.random_plan(
        data,
        list(range(num_samples)),
        dist.get_world_size(),
        seed,
        num_layers=dc.adapter.spec.num_layers,
        mode="phases",
        min_size=shard_size,
    )
    loss = adapter_step(dc, plan, data, adapter_models.item)
    grads = dc.full_gradients()
    dc.optimizer(lr=1e-2).step()
    after = {n: _whole(p) for n, p in model.named_parameters()}
    return {
        "loss": loss,
        "grads": grads,
        "frozen_dtypes": sorted({str(v.dtype) for v in frozen.values()}),
        "frozen_unchanged": all(torch.equal(after[n], v) and after[n].dtype == v.dtype for n, v in frozen.items()),
        "trainable_dtypes": sorted({str(after[n].dtype) for n in grads}),
    }


def case_autocast_step(seed: int, num_samples: int) -> list[dict]:
    """PEFT LoRA Llama (fp32) on a random plan with SP 1 and SP > 1 in one step, each
    micro-batch's forward under CPU autocast to bfloat16 (what DataCentricTrainer runs for
    bf16=True), as planned and again with recompute off: per run the loss, the trainable
    parameters' gradients and their dtypes, the plan."""
    from dcparallel.data.collate import resolve_collate
    from dcparallel.plan.types import MicroBatch

    model = lora_models.build("lora-llama")
    dc = Engine(model)
    data = adapter_models.make_data("hf-llama", num_samples, seed)
    planned = support.random_plan(
        data,
        list(range(num_samples)),
        dist.get_world_size(),
        seed,
        num_layers=dc.adapter.spec.num_layers,
        mode="phases",
    )
    rank = dist.get_rank()
    collate = resolve_collate(dc.adapter.collate, dc.adapter.kind)
    runs = []
    for plan in (planned, support.capped(planned, 0)):
        for mb, ranks in plan.work_of(rank):
            items = {s: adapter_models.item(data, s) for s in mb.sample_ids}
            batch = collate(items, MicroBatch(mb.sample_ids, mb.layout), ranks, rank)
            with dc.micro_batch(batch) as ctx:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = dc.adapter.loss_fn(dc.model, batch, ctx)
                ctx.backward(loss)
        loss = dc.sync_gradients()
        grads = dc.full_gradients()
        runs.append(
            {
                "loss": loss,
                "grads": grads,
                "dtypes": sorted({str(g.dtype) for g in grads.values()}),
                "plan": plan.to_json(),
            }
        )
    return runs


def case_state_bytes(kind: str, shard_size: int) -> dict:
    """Bytes this rank holds for gradients and optimizer state after one step of ``kind``, from
    the tensors themselves, with the adapters' element count and the model's."""
    model = lora_models.build(kind)
    dc = Engine(model, shard_size=shard_size)
    data = adapter_models.make_data(lora_models.BASE[kind], 4, 3)
    plan = support.random_plan(
        data,
        list(range(4)),
        dist.get_world_size(),
        3,
        num_layers=dc.adapter.spec.num_layers,
        mode="world",
        min_size=shard_size,
    )
    adapter_step(dc, plan, data, adapter_models.item)
    opt = dc.optimizer(lr=1e-2)
    opt.step()
    grads = dc.grad_sync.flat_grad
    states = [opt.exp_avg, opt.exp_avg_sq] + (
        [opt.master]
        if getattr(opt, "master", None) is not None and opt.master.data_ptr() != opt._param_shard.data_ptr()
        else []
    )
    return {
        "grad_bytes": grads.numel() * grads.element_size(),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in states),
        "adapter_numel": lora_models.adapter_numel(model),
        "model_numel": sum(p.numel() for p in model.parameters()),
        "world": dist.get_world_size(),
    }


def case_prepare_refuses_diverged_adapters() -> str:
    """Each rank initializes its adapters from its own generator: `prepare` refuses (the message)."""
    from dcparallel.api import DataCentricParallel

    rank = dist.get_rank()
    dc = DataCentricParallel(lora_models.build("lora-llama", seed=0, adapter_seed=rank), memory_bytes=2**30)
    data = adapter_models.make_data("hf-llama", 6, 5)
    try:
        dc.prepare(
            [data.docs[i] for i in range(6)],
            lengths=[len(data.docs[i]) for i in range(6)],
            samples_per_step=4,
            cost="analytic",
            planning="thread",
        )
    except ValueError as e:
        return str(e)
    return "not refused"
