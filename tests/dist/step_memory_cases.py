"""Gloo worker functions measuring what a rank holds around the optimizer step (module level,
for spawn): live storages after ``opt.step()`` and the peak of sync + clip + step, each storage
counted once (`tests.memory`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dcparallel.cost.base import state_recipe
from dcparallel.data.collate import text_batch
from dcparallel.loss import per_token_loss
from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.runtime.engine import Engine
from tests import support
from tests.memory import LiveBytes, live_storages

#: a bf16 reference Llama of 17.3M parameters: big enough that the 16 MiB step chunk is small
CONFIG = {"vocab_size": 8192, "hidden": 384, "num_layers": 6, "num_heads": 4, "ffn_hidden": 1024}


def _micro_batches(dc: Engine, data, plan) -> None:
    """This rank's micro-batches of the plan, without the sync (no overlap: the whole sync
    runs in `sync_gradients`)."""
    rank = dist.get_rank()
    for mb, ranks in plan.work_of(rank):
        batch = text_batch(mb, ranks, rank, data.docs, data.labels)
        with dc.micro_batch(batch, last=False) as ctx:
            ptl, _ = per_token_loss(dc.model(batch.inputs, batch.positions), batch.labels)
            ctx.backward(ctx.token_loss(ptl, batch.loss_mask))


def case_step_memory(shard_size: int) -> dict:
    """A bf16 Llama, one step of one sample per SP group (SP ``shard_size``): bytes per
    parameter alive after ``opt.step()`` (storages created since the model was built), and the
    peak of sync + clip + step over everything alive, less what was alive before the model."""
    torch.manual_seed(0)
    data = support.make_data("llama", 2, seed=1)
    plan = support.random_plan(
        data,
        [0, 1],
        dist.get_world_size(),
        0,
        num_layers=CONFIG["num_layers"],
        sizes=(shard_size,),
        min_size=shard_size,
    )
    before = live_storages()
    model = Llama(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    dc = Engine(model, layers=model.layers, num_heads=CONFIG["num_heads"], shard_size=shard_size)
    opt = dc.optimizer(lr=1e-3, weight_decay=0.1)
    numel = sum(p.numel() for p in model.parameters())
    _micro_batches(dc, data, plan)
    base = sum(n for k, n in live_storages().items() if before.get(k) != n)
    with LiveBytes() as meter:
        start = meter.now
        dc.sync_gradients()
        dc.clip_grad_norm_(1e-3)
        opt.step()
    peak = base + meter.peak - start
    after = sum(n for k, n in live_storages().items() if before.get(k) != n)
    recipe = state_recipe(dc.adapter.spec, dist.get_world_size(), shard_size)
    return {
        "numel": numel,
        "spec_numel": dc.adapter.spec.num_params,
        "after_per_param": after / numel,
        "peak_per_param": peak / numel,
        "base_per_param": base / numel,
        "recipe_states_per_param": (recipe.states - recipe.gathered) / numel,
        "recipe_peak_per_param": recipe.step_peak / numel,
    }
