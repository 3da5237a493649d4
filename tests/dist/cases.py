"""Functions the gloo workers run (module level so that spawn can pickle them by name).

Each runs on every rank at once and returns plain tensors / numbers for the test process
to check against a single-process reference."""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist

from dcparallel.data.collate import padded_length, video_batch
from dcparallel.models.attention import AttnPattern, sdpa_attention
from dcparallel.models.dit import draw_flow
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.sample import SamplePacker
from dcparallel.plan.steps import Step
from dcparallel.plan.types import MicroBatch, StepPlan
from dcparallel.runtime import comm
from dcparallel.runtime.engine import Engine
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.runtime.ulysses import ulysses_attention
from dcparallel.spec import Layout, Workload
from tests.support import (
    NUM_HEADS,
    NUM_LAYERS,
    capped,
    make_data,
    make_model,
    random_plan,
    reference_adamw,
    run_rank_step,
)

_GROUPS: dict[int, ProcessGroups] = {}


def groups(num_heads: int = NUM_HEADS) -> ProcessGroups:
    """One ProcessGroups per worker process (creating groups is collective: every rank
    runs the same commands in the same order, so the cache stays in step)."""
    if num_heads not in _GROUPS:
        _GROUPS[num_heads] = ProcessGroups(num_heads)
    return _GROUPS[num_heads]


def my_block(size: int) -> tuple[int, ...]:
    r = dist.get_rank()
    start = r // size * size
    return tuple(range(start, start + size))


# ---------------------------------------------------------------- groups and helpers


def case_groups() -> dict:
    pg = groups()
    sums = {}
    for block in pg.blocks:
        if dist.get_rank() in block:
            t = torch.tensor([float(dist.get_rank() + 1)])
            group = pg.group(block)
            if len(block) == pg.world_size:
                comm.all_reduce_sum_(t)
            elif group is not None:  # a one-rank block has no process group: nothing to reduce
                dist.all_reduce(t, group=group)
            sums[block] = float(t)
    singles_without_group = all(pg.group((r,)) is None for r in range(pg.world_size))
    errors = []
    for bad in [(0, 2), (1, 2), tuple(range(pg.world_size + 1))]:
        try:
            pg.group(bad)
        except ValueError as e:
            errors.append(str(e))
    return {
        "blocks": pg.blocks,
        "sums": sums,
        "errors": errors,
        "seconds": pg.creation_seconds,
        "describe": pg.describe(),
        "singles_without_group": singles_without_group,
    }


def case_comm() -> dict:
    r = dist.get_rank()
    gathered = comm.gather_dict({"rank": r, "square": r * r})
    comm.check_equal(comm.digest({"plan": [1, 2, 3]}), "plan")
    try:
        comm.check_equal("odd" if r % 2 else "even", "plan hash")
        mismatch = None
    except RuntimeError as e:
        mismatch = str(e)
    return {"gathered": gathered, "mismatch": mismatch}


def case_control_group(timeout_s: str) -> dict:
    import os

    os.environ["DCPARALLEL_CONTROL_TIMEOUT_S"] = timeout_s
    try:
        g = comm.control_group()
        gathered = comm.all_gather_object(comm.world_rank() * 10, g)
        return {
            "backend": dist.get_backend(g),
            "same": comm.control_group() is g,
            "gathered": gathered,
            "timeout": comm.control_timeout_s(),
        }
    finally:
        del os.environ["DCPARALLEL_CONTROL_TIMEOUT_S"]


# ---------------------------------------------------------------- Ulysses attention


def case_ulysses(pattern_kind: str, seed: int) -> dict:
    """Every SP degree the world allows: Ulysses on shards vs. the kernel on the whole
    rows, forward output and the gradients of q, k, v. Returns max relative errors and the
    largest |value| found on padding (output and gradients), per SP degree."""
    pg = groups()
    out = {}
    for sp in pg.sizes:
        block = my_block(sp)
        slot = block.index(dist.get_rank())
        rng = random.Random(seed * 100 + sp)
        g = torch.Generator().manual_seed(seed * 100 + sp)
        b, h, d = 2, NUM_HEADS, 8
        if pattern_kind == "causal":  # packed documents of uneven lengths, not divisible by sp
            lens = [rng.randint(1, 13) for _ in range(rng.randint(1, 4))]
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            if cu[-1] % 2 == 0:  # odd total: padded at every SP degree > 1
                cu[-1] += 1
            seq_len, pattern, frames = cu[-1], AttnPattern("causal"), 1
        else:
            frames, spatial = rng.choice([(3, 5), (5, 3), (1, 9)])  # odd: padded at SP > 1
            seq_len = frames * spatial
            cu = [0, seq_len]
            pattern = AttnPattern(pattern_kind, frames)
        q, k, v, w = (torch.randn(b, seq_len, h, d, generator=g, dtype=torch.float64) for _ in range(4))
        ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = sdpa_attention(*ref_in, pattern, cu)
        (ref * w).sum().backward()

        plen = padded_length(seq_len, sp)
        ls = plen // sp

        def shard(x):
            x = torch.cat([x, x.new_zeros(b, plen - seq_len, h, d)], dim=1)
            return x[:, slot * ls : (slot + 1) * ls].clone()

        mine = [shard(x).requires_grad_() for x in (q, k, v)]
        o = ulysses_attention(*mine, pattern, group=pg.group(block), cu_seqlens=cu)
        (o * shard(w)).sum().backward()
        parts = comm.all_gather_object([o.detach()] + [x.grad for x in mine], group=pg.group(block))
        full = [torch.cat([p[i] for p in parts], dim=1) for i in range(4)]
        pad_max = max(float(t[:, seq_len:].abs().max()) if plen > seq_len else 0.0 for t in full)
        errs = [comm_rel(full[0][:, :seq_len], ref.detach())]
        errs += [comm_rel(full[i + 1][:, :seq_len], ref_in[i].grad) for i in range(3)]
        out[sp] = {"errors": errs, "pad_max": pad_max, "seq_len": seq_len, "padded": plen}
    return out


def comm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def case_heads_error() -> str:
    """3 heads cannot be split over an SP group of 2 ranks."""
    pg = groups()
    x = torch.randn(1, 4, 3, 8)
    try:
        ulysses_attention(x, x, x, AttnPattern("causal"), group=pg.group(my_block(2)))
    except ValueError as e:
        return str(e)
    return ""


# ---------------------------------------------------------------- the engine


def case_engine(kind: str, seeds: list[int], num_samples: int, backward_outside: bool = False) -> list[dict]:
    """For each seed: a random step plan, run on every rank; the loss and every gradient
    after sync_gradients. Two plans in a row on one engine (the second step must start from
    zero gradients, also on ranks that had no micro-batch)."""
    world = dist.get_world_size()
    model = make_model(kind)
    dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS, groups=groups())
    results = []
    for i, seed in enumerate(seeds):
        data = make_data(kind, num_samples, seed)
        mode = ("world", "idle", "random", "phases")[i % 4]
        plan = random_plan(data, list(range(num_samples)), world, seed, num_layers=len(model.layers), mode=mode)
        loss = run_rank_step(dc, data, plan, dist.get_rank(), backward_outside)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results.append({"seed": seed, "loss": loss, "grads": grads, "count": dc.last_count, "plan": plan.to_json()})
    return results


#: per world: planning sizes (tokens, for the unit tests' tiny LM under its 1.5 GiB budget) for
#: which the per-sample packing splits the long sample's group into sub-groups
PACKED_SIZES = {2: (57303, 1049, 4195, 1947), 4: (38723, 282, 3529, 3969, 4751, 137, 1704, 3805, 4040)}


def packed_plan(world: int) -> StepPlan:
    """The plan `dcp`'s per-sample packing makes for `PACKED_SIZES[world]`, its micro-batches'
    recompute capped at the test model's layers (the planning model has more)."""
    from tests.unit._models import TINY_LM, cluster, cost

    sizes = PACKED_SIZES[world]
    cl = cluster(world, world)
    ctx = PlanContext(Workload(TINY_LM, sizes), cost(TINY_LM, cl), cl)
    packer = SamplePacker(ctx, "pac")
    step = Step(0, tuple(range(len(sizes))))
    return capped(packer.step_plan(step, packer.plan(list(step.sample_ids))[0]), NUM_LAYERS)


def case_packed(seed: int) -> dict:
    """Every rank plans the packed step itself, runs its part, syncs: loss, gradients, plan."""
    plan = packed_plan(dist.get_world_size())
    model = make_model("llama")
    dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS, groups=groups())
    data = make_data("llama", len(plan.sample_ids), seed)
    loss = run_rank_step(dc, data, plan, dist.get_rank())
    return {
        "loss": loss,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "plan": plan.to_json(),
    }


def case_optimizer(kind: str, seed: int, use_zero: bool, num_steps: int) -> dict[str, torch.Tensor]:
    """num_steps AdamW steps on the same data: ZeRO-1 (sharded state) or a plain torch
    optimizer over the synced gradients; the parameters afterwards."""
    world = dist.get_world_size()
    model = make_model(kind)
    dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS, groups=groups())
    if use_zero:
        opt = dc.optimizer(lr=1e-2, weight_decay=0.1)
    else:
        opt = reference_adamw(model)
    data = make_data(kind, 6, seed)
    for step in range(num_steps):
        plan = random_plan(data, list(range(6)), world, seed + step, num_layers=len(model.layers))
        run_rank_step(dc, data, plan, dist.get_rank())
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- per-sample randomness


def case_noise(epoch: int) -> dict:
    """In the SP group of ranks (0, 1): both ranks draw each sample's flow-matching noise
    and timestep from ctx.generator; returned for the test process to compare."""
    r = dist.get_rank()
    model = make_model("dit")
    dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS, groups=groups())
    dc.set_epoch(epoch)
    if r >= 2:  # ranks outside the group draw nothing in this case
        return {}
    data = make_data("dit", 4, 0)
    same = [s for s in range(4) if data.shape_of[s] == data.shape_of[0]][:2]
    mb = MicroBatch(tuple(same), Layout(2, len(same)))
    batch = video_batch(mb, (0, 1), r, data.docs, data.positions, data.frames[same[0]])
    drawn = {}
    with dc.micro_batch(batch) as ctx:
        for sid in batch.sample_ids:
            t, noise = draw_flow(ctx.generator(sid), batch.seq_len, batch.inputs.shape[-1])
            drawn[sid] = (t, noise)
        drawn[99] = (torch.rand((), generator=ctx.generator(same[0])), None)
    return drawn


def case_clip_schedule(seed: int, max_norm: float, num_steps: int) -> dict:
    """ZeRO-1 AdamW driven by a warmup + cosine LambdaLR, with global-norm clipping of the
    synced gradients: the pre-clip norms and the parameters afterwards."""
    world = dist.get_world_size()
    model = make_model("llama")
    dc = Engine(model, layers=model.layers, num_heads=NUM_HEADS, groups=groups())
    opt = dc.optimizer(lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, clip_case_schedule)
    data = make_data("llama", 6, seed)
    norms = []
    for step in range(num_steps):
        plan = random_plan(data, list(range(6)), world, seed + step, num_layers=len(model.layers))
        run_rank_step(dc, data, plan, dist.get_rank())
        norms.append(dc.clip_grad_norm_(max_norm))
        opt.step()
        sched.step()
    return {"norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def clip_case_schedule(step: int) -> float:
    return min(1.0, (step + 1) / 2) * (0.5 + 0.5 * math.cos(math.pi * step / 4))
