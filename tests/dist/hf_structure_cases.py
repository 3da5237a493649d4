"""Gloo worker functions for the structure-family parity tests (module level, for spawn)."""

from __future__ import annotations

import torch.distributed as dist

from dcparallel.data.collate import resolve_collate
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from tests.hf_structure_families import build, make_data
from tests.support import random_plan


def case_family_engine(kind: str, seeds: list[int], num_samples: int) -> list[dict]:
    """Random plans (SP 1/2/4, idle ranks, uneven counts, two phases, random recompute) of a
    transformers family driven through its adapter, as `adapter_cases.case_adapter_engine`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build(kind)
    dc = Engine(model)
    collate = resolve_collate(dc.adapter.collate, dc.adapter.kind)
    results = []
    for i, seed in enumerate(seeds):
        data = make_data(num_samples, seed)
        mode = ("world", "idle", "random", "phases")[i % 4]
        plan = random_plan(data, list(range(num_samples)), world, seed, num_layers=dc.adapter.spec.num_layers,
                           mode=mode)
        for mb, ranks in plan.work_of(rank):
            batch = collate({s: data.docs[s] for s in mb.sample_ids}, MicroBatch(mb.sample_ids, mb.layout),
                            ranks, rank)
            with dc.micro_batch(batch) as ctx:
                ctx.backward(dc.adapter.loss_fn(model, batch, ctx))
        loss = dc.sync_gradients()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results.append({"loss": loss, "grads": grads, "plan": plan.to_json()})
    return results
