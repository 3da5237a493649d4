"""Gloo worker functions for the vision-language parity tests (module level, for spawn)."""

from __future__ import annotations

import torch.distributed as dist

from dcparallel.adapters import find_adapter
from dcparallel.runtime.engine import Engine
from tests import vlm_families
from tests.dist.cases_common import PLAN_MODES, adapter_step
from tests.support import random_plan


def case_vlm_engine(
    kind: str, seeds: list[int], num_samples: int, freeze_vision: bool, modes: tuple[str, ...] = PLAN_MODES
) -> list[dict]:
    """Per seed a random plan (SP 1/2/4, idle ranks, packed chats, random recompute;
    ``modes`` in turn) of the mixed chats through the VLM adapter's collate and loss: the
    step's loss, the gradients of the trainable parameters, the plan."""
    model = vlm_families.build(kind)
    dc = Engine(model, adapter=find_adapter(model, freeze_vision=freeze_vision))
    results = []
    for i, seed in enumerate(seeds):
        data = vlm_families.make_data(num_samples, seed, kind)
        plan = random_plan(
            data,
            list(range(num_samples)),
            dist.get_world_size(),
            seed,
            num_layers=dc.adapter.spec.num_layers,
            mode=modes[i % len(modes)],
        )
        loss = adapter_step(dc, plan, data, vlm_families.item)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append({"loss": loss, "grads": grads, "plan": plan.to_json()})
    return results


def case_vlm_epoch(kind: str, num_samples: int, profile_path: str) -> dict:
    """One epoch of the mixed chats through the public API: `prepare` profiles the model
    (synthetic text samples through the VLM collate and loss, then the vision tower per patch
    bucket), the loader plans each step (`dcp`, the chats' sizes carrying their patches) and
    its DataLoader workers collate the chats (images, videos, their extras)."""
    import math

    from dcparallel import DataCentricParallel
    from tests.dist.cases_common import EPOCH_PROFILE
    from tests.support import train_steps

    data = vlm_families.make_data(num_samples, 5, kind)
    model = vlm_families.build(kind)
    dc = DataCentricParallel(model, memory_bytes=2**30, gpus_per_node=dist.get_world_size())
    loader = dc.prepare(
        data.samples,
        lengths=[vlm_families.size(s) for s in data.samples],
        samples_per_step=8,
        profile_path=profile_path,
        profiler_config=EPOCH_PROFILE,
        planning="thread",
    )
    ran, losses = [], []
    for step, loss in train_steps(dc, model, loader, dc.optimizer(lr=1e-3)):
        ran += [(step.index, batch.ranks, batch.sample_ids, batch.layout.sp) for batch in step]
        losses.append(loss)
    assert all(math.isfinite(x) for x in losses)
    return {"ran": ran, "losses": losses, "vision": dc.profile.vision}
