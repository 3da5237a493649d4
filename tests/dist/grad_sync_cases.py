"""Functions the gloo workers run for the bucketed, overlapped gradient sync (module level
so that spawn can pickle them by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dcparallel.data.collate import text_batch
from dcparallel.loss import per_token_loss
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
        take = ids[i : i + r] if r < world - 1 else ids[i:]
        i += len(take)
        groups_.append(GroupPlan((r,), tuple(MicroBatch((s,), Layout(1, 1)) for s in take)))
    plan = StepPlan(seed, tuple(ids), tuple(groups_), sum(int(data.docs[s].numel()) for s in ids))
    plan.validate(world)
    return plan


def _unbucketed_and_bucketed(a_model, b_model, bucket_bytes: int) -> tuple[Engine, Engine]:
    """Engine A syncs its whole buffer in one all-reduce after the last micro-batch; engine B
    in ``bucket_bytes`` buckets (overlapped with the last backward unless a case turns it off)."""
    a = Engine(a_model, layers=a_model.layers, num_heads=NUM_HEADS, groups=groups())
    b = Engine(b_model, layers=b_model.layers, num_heads=NUM_HEADS, groups=groups())
    a.grad_sync.set_bucket_bytes(0)
    a.grad_sync.overlap = False
    b.grad_sync.set_bucket_bytes(bucket_bytes)
    return a, b


def case_bucketed_vs_unbucketed(kind: str, seeds: list[int], bucket_bytes: int, num_samples: int = 8) -> list[dict]:
    """The same plans on two engines over identical models: A reduces the whole buffer in
    one all-reduce after the last micro-batch (the unbucketed sync), B in `bucket_bytes`
    buckets launched during the last backward (rank 0 does not announce its last micro-batch,
    so its buckets all go out in sync_gradients: the order stays the same). Returns per plan
    both buffers and how many of B's buckets went out during backward."""
    world, rank = dist.get_world_size(), dist.get_rank()
    a_model, b_model = make_model(kind), make_model(kind)
    a, b = _unbucketed_and_bucketed(a_model, b_model, bucket_bytes)
    out = []
    for i, seed in enumerate(seeds):
        data = make_data(kind, num_samples, seed)
        mode = MODES[i % len(MODES)]
        plan = _plan(data, num_samples, world, seed, mode, len(a_model.layers))
        b.grad_sync.overlap = rank != 0
        loss_a = run_rank_step(a, data, plan, rank)
        loss_b = run_rank_step(b, data, plan, rank)
        out.append(
            {
                "mode": mode,
                "num_mbs": len(plan.work_of(rank)),
                "loss_a": loss_a,
                "loss_b": loss_b,
                "a": a.flat_grad.clone(),
                "b": b.flat_grad.clone(),
                "num_buckets": b.grad_sync.num_buckets,
                "overlapped": b.grad_sync.last_overlapped,
                "a_buckets": a.grad_sync.num_buckets,
                "grads_are_views": all(
                    p.grad.data_ptr() == v.data_ptr() for p, v in zip(b.params, b.grad_sync.views, strict=True)
                ),
            }
        )
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


#: which (expert, rank, last micro-batch?) the loss reaches, per mode of `case_unreached_experts`
REACH = {
    "never": lambda name, rank, last: False,
    "rank0": lambda name, rank, last: rank == 0,
    "earlier": lambda name, rank, last: not last,  # in the buffer from earlier micro-batches only
    "split": lambda name, rank, last: rank == (0 if name == "tail" else 1),
}


def _model_with_experts() -> tuple[nn.Module, dict[str, nn.Module]]:
    """The reference Llama plus two "experts" its forward never uses: one in the middle of the
    parameter order (a child of block 1), one last (so in bucket 0, with the loss)."""
    model = make_model("llama")
    torch.manual_seed(1)
    model.layers[1].expert = nn.Linear(6, 5, bias=False)
    model.tail = nn.Linear(7, 3, bias=False)
    return model, {"middle": model.layers[1].expert, "tail": model.tail}


def _expert_step(dc: Engine, experts: dict[str, nn.Module], data, plan, rank: int, reach) -> float:
    work = plan.work_of(rank)
    for j, (mb, ranks) in enumerate(work):
        batch = text_batch(mb, ranks, rank, data.docs, data.labels)
        last = j == len(work) - 1
        with dc.micro_batch(batch, last=last) as ctx:
            ptl, _ = per_token_loss(dc.model(batch.inputs, batch.positions), batch.labels)
            loss = ctx.token_loss(ptl, batch.loss_mask)
            for name, expert in experts.items():
                if reach(name, rank, last):  # a token routed to this expert
                    loss = loss + expert.weight.square().sum()
            ctx.backward(loss)
    return dc.sync_gradients()


def case_unreached_experts(seeds: list[int], bucket_bytes: int, num_samples: int = 8) -> list[dict]:
    """Parameters the last backward does not reach on some ranks (`REACH`): engine A syncs
    in one all-reduce after the last micro-batch, B in `bucket_bytes` buckets overlapped
    with the last backward on every rank. Returns per plan both buffers and how many of B's
    buckets went out during that backward."""
    world, rank = dist.get_world_size(), dist.get_rank()
    (a_model, a_experts), (b_model, b_experts) = _model_with_experts(), _model_with_experts()
    a, b = _unbucketed_and_bucketed(a_model, b_model, bucket_bytes)
    out = []
    for i, seed in enumerate(seeds):
        mode = list(REACH)[i % len(REACH)]
        data = make_data("llama", num_samples, seed)
        plan = random_plan(data, list(range(num_samples)), world, seed, num_layers=len(a_model.layers))
        loss_a = _expert_step(a, a_experts, data, plan, rank, REACH[mode])
        loss_b = _expert_step(b, b_experts, data, plan, rank, REACH[mode])
        out.append(
            {
                "mode": mode,
                "num_mbs": len(plan.work_of(rank)),
                "loss_a": loss_a,
                "loss_b": loss_b,
                "a": a.flat_grad.clone(),
                "b": b.flat_grad.clone(),
                "num_buckets": b.grad_sync.num_buckets,
                "overlapped": b.grad_sync.last_overlapped,
            }
        )
    return out


def _record_sync(group, flat: torch.Tensor, calls: list) -> dict:
    """Wraps torch.distributed's all-reduce, reduce and reduce-scatters so that each call on
    ``group`` is appended to ``calls`` as (op, element offset in ``flat``, numel, dst); returns
    the originals (`_restore`)."""
    names = [
        n
        for n in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
        if hasattr(dist, n)
    ]
    originals = {n: getattr(dist, n) for n in names}

    def wrap(name, fn):
        def call(t, *args, **kwargs):
            if kwargs.get("group") is group:
                offset = (t.data_ptr() - flat.data_ptr()) // 4
                calls.append((name, offset, t.numel(), kwargs.get("dst")))
            return fn(t, *args, **kwargs)

        return call

    for n, fn in originals.items():
        setattr(dist, n, wrap(n, fn))
    return originals


def _restore(originals: dict) -> None:
    for n, fn in originals.items():
        setattr(dist, n, fn)


def case_zero1_sync(seeds: list[int], bucket_bytes: int, max_norm: float, num_samples: int = 8) -> list[dict]:
    """Engine A: replicated, one all-reduce of its whole buffer after the last micro-batch, no
    optimizer. Engine B: `bucket_bytes` buckets overlapped with the last backward and the
    ZeRO-1 optimizer. Per plan (`MODES` in turn): the collectives B's sync issued on its group
    (`_record_sync`), both buffers, both losses, B's whole gradients gathered
    (`full_gradients`), whether B left any p.grad or let `gradients()` through, and both
    clipped norms and buffers (B's clip works on shards)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    a_model, b_model = make_model("llama"), make_model("llama")
    a, b = _unbucketed_and_bucketed(a_model, b_model, bucket_bytes)
    b.optimizer(lr=1e-2)
    out = []
    for i, seed in enumerate(seeds):
        data = make_data("llama", num_samples, seed)
        mode = MODES[i % len(MODES)]
        plan = _plan(data, num_samples, world, seed, mode, len(a_model.layers))
        loss_a = run_rank_step(a, data, plan, rank)
        calls: list = []
        originals = _record_sync(b.grad_sync.group, b.flat_grad, calls)
        try:
            loss_b = run_rank_step(b, data, plan, rank)
        finally:
            _restore(originals)
        res = {
            "mode": mode,
            "num_mbs": len(plan.work_of(rank)),
            "loss_a": loss_a,
            "loss_b": loss_b,
            "calls": calls,
            "num_buckets": b.grad_sync.num_buckets,
            "overlapped": b.grad_sync.last_overlapped,
            "shard_numel": b.shard_numel,
            "numel": b.numel,
            "a": a.flat_grad.clone(),
            "b": b.flat_grad.clone(),
            "grads_none": all(p.grad is None for p in b.params),
        }
        try:
            b.gradients()
            res["gradients_refused"] = False
        except ValueError:
            res["gradients_refused"] = True
        res["full_a"], res["full_b"] = a.full_gradients(), b.full_gradients()
        res["norm_a"], res["norm_b"] = a.clip_grad_norm_(max_norm), b.clip_grad_norm_(max_norm)
        res["clipped_a"], res["clipped_b"] = a.flat_grad.clone(), b.flat_grad.clone()
        out.append(res)
    return out
