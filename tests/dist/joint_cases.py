"""Gloo worker functions for the joint-attention parity and epoch tests (module level, for spawn)."""

from __future__ import annotations

import torch.distributed as dist

from dcparallel.api import DataCentricParallel
from dcparallel.plan.policies import ALL
from dcparallel.plan.types import MicroBatch
from dcparallel.profile.profiler import ProfilerConfig
from dcparallel.runtime.engine import Engine
from tests.joint_models import MIX, TEXT_TOKENS, JointVideoSet, build, item, make_data
from tests.support import random_plan


def case_joint_engine(kind: str, seeds: list[int], num_samples: int) -> list[dict]:
    """Random plans (SP 1/2/4, idle ranks, uneven counts, phases, random recompute) of a joint
    attention model driven through its adapter: its collate, loss_fn and hooks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build(kind)
    dc = Engine(model)
    results = []
    for i, seed in enumerate(seeds):
        data = make_data(kind, num_samples, seed)
        mode = ("world", "idle", "random", "phases")[i % 4]
        plan = random_plan(data, list(range(num_samples)), world, seed, num_layers=dc.adapter.spec.num_layers,
                           mode=mode)
        for mb, ranks in plan.work_of(rank):
            batch = dc.adapter.collate({s: item(data, s) for s in mb.sample_ids},
                                       MicroBatch(mb.sample_ids, mb.layout), ranks, rank)
            with dc.micro_batch(batch) as ctx:
                ctx.backward(dc.adapter.loss_fn(model, batch, ctx))
        loss = dc.sync_gradients()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results.append({"loss": loss, "grads": grads, "plan": plan.to_json()})
    return results


def case_joint_epoch(kind: str, profile_path: str) -> dict:
    """Every policy trains one epoch of the mixed-resolution set (2 copies of the mix) at world
    2 through `prepare` (profiled once, the cache reused); per policy the (step, group, sample
    ids) this rank ran and the step losses."""
    shapes = MIX[kind] * 2
    config = ProfilerConfig(repeats=1, max_repeats=1, warmup=1, min_time_s=0.0, max_mbs=2, modes=("none", "full"))
    out = {}
    for policy in ALL:
        model = build(kind)
        dc = DataCentricParallel(model, policy=policy, memory_bytes=2**30, context_tokens=TEXT_TOKENS)
        loader = dc.prepare(JointVideoSet(shapes, model), lengths=shapes, samples_per_step=8,
                            profile_path=profile_path, profiler_config=config)
        opt = dc.optimizer(lr=1e-3)
        ran, losses = [], []
        for step in loader:
            for batch in step:
                with dc.micro_batch(batch) as ctx:
                    ctx.backward(dc.loss_fn(model, batch, ctx))
                ran.append((step.index, batch.ranks, batch.sample_ids))
            losses.append(dc.sync_gradients())
            opt.step()
        out[policy] = {"ran": ran, "losses": losses, "rank": dist.get_rank()}
    return out
