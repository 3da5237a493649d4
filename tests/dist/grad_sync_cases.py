"""Functions the gloo workers run for the bucketed, overlapped gradient sync (module level
so that spawn can pickle them by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dcparallel.runtime.engine import Engine
from tests.dist.cases import groups
from tests.support import NUM_HEADS, make_data, make_model, random_plan, run_rank_step

MODES = ("random", "idle", "phases", "world", "uneven")


def _plan(data, num_samples: int, world: int, seed: int, mode: str, num_layers: int):
    if mode != "uneven":
        return random_plan(data, list(range(num_samples)), world, seed, num_layers=num_layers, mode=mode)
    # every rank its own SP=1 group: rank r gets r micro-batches' worth of samples (rank 0 idle)
    from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
    from dcparallel.spec import Layout

    ids, groups_, i = list(range(num_samples)), [], 0
    for r in range(world):
        take = ids[i:i + r] if r < world - 1 else ids[i:]
        i += len(take)
        groups_.append(GroupPlan((r,), tuple(MicroBatch((s,), Layout(1, 1)) for s in take)))
    plan = StepPlan(seed, tuple(ids), tuple(groups_), sum(int(data.docs[s].numel()) for s in ids))
    plan.validate(world)
    return plan


def case_bucketed_vs_unbucketed(kind: str, seeds: list[int], bucket_bytes: int, num_samples: int = 8) -> list[dict]:
    """The same plans on two engines over identical models: A reduces the whole buffer in
    one all-reduce after the last micro-batch (the unbucketed sync), B in `bucket_bytes`
    buckets launched during the last backward (rank 0 does not announce its last micro-batch,
    so its buckets all go out in sync_gradients: the order stays the same). Returns per plan
    both buffers and how many of B's buckets went out during backward."""
    world, rank = dist.get_world_size(), dist.get_rank()
    a_model, b_model = make_model(kind), make_model(kind)
    a = Engine(a_model, layers=a_model.layers, num_heads=NUM_HEADS, groups=groups())
    b = Engine(b_model, layers=b_model.layers, num_heads=NUM_HEADS, groups=groups())
    a.grad_sync.set_bucket_bytes(0)
    a.grad_sync.overlap = False
    b.grad_sync.set_bucket_bytes(bucket_bytes)
    out = []
    for i, seed in enumerate(seeds):
        data = make_data(kind, num_samples, seed)
        mode = MODES[i % len(MODES)]
        plan = _plan(data, num_samples, world, seed, mode, len(a_model.layers))
        b.grad_sync.overlap = rank != 0
        loss_a = run_rank_step(a, data, plan, rank)
        loss_b = run_rank_step(b, data, plan, rank)
        out.append({"mode": mode, "num_mbs": len(plan.work_of(rank)), "loss_a": loss_a, "loss_b": loss_b,
                    "a": a.flat_grad.clone(), "b": b.flat_grad.clone(), "num_buckets": b.grad_sync.num_buckets,
                    "overlapped": b.grad_sync.last_overlapped, "a_buckets": a.grad_sync.num_buckets,
                    "grads_are_views": all(p.grad.data_ptr() == v.data_ptr()
                                           for p, v in zip(b.params, b.grad_sync.views, strict=True))})
    return out


def case_idle_steps(kind: str, num_steps: int, bucket_bytes: int) -> list[float]:
    """Several steps in a row where the same ranks stay idle, others run 1..3 micro-batches:
    every rank must finish every step (no deadlock); the losses come back."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(kind)
    dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS, groups=groups())
    dc.grad_sync.set_bucket_bytes(bucket_bytes)
    opt = dc.optimizer(lr=1e-2)
    losses = []
    for step in range(num_steps):
        data = make_data(kind, 6, 100)  # the same samples, laid out differently each step
        plan = _plan(data, 6, world, 100 + step, ("uneven", "idle")[step % 2], len(model.layers))
        losses.append(run_rank_step(dc, data, plan, rank))
        opt.step()
    return losses
