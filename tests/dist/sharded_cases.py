"""Gloo worker functions for the parameter-sharded runtime (shard_size > 1; module level, for spawn)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dcparallel.data.collate import text_batch
from dcparallel.loss import per_token_loss
from dcparallel.plan.types import GroupPlan, MicroBatch, StepPlan
from dcparallel.runtime.engine import Engine
from dcparallel.spec import Layout
from tests import adapter_models, support
from tests.dist.cases_common import adapter_step

#: reference models (tests/support.py), driven as its run_rank_step does; the other kinds are
#: library models driven through their adapters (tests/adapter_models.py)
SUPPORT_KINDS = ("dit", "dit-factorized", "llama", "llama-tied")
MODES = ("phases", "idle", "random", "world")


def _engine(kind: str, shard_size: int) -> Engine:
    if kind in SUPPORT_KINDS:
        model = support.make_model(kind)
        return Engine(model, layers=model.layers, num_heads=support.NUM_HEADS, shard_size=shard_size)
    return Engine(adapter_models.build(kind), shard_size=shard_size)


def _data(kind: str, num_samples: int, seed: int):
    return (support.make_data if kind in SUPPORT_KINDS else adapter_models.make_data)(kind, num_samples, seed)


def _plan(
    dc: Engine, kind: str, data, num_samples: int, seed: int, mode: str, recompute: bool, min_size: int
) -> StepPlan:
    plan = support.random_plan(
        data,
        list(range(num_samples)),
        dist.get_world_size(),
        seed,
        num_layers=dc.adapter.spec.num_layers,
        mode=mode,
        min_size=min_size,
    )
    return plan if recompute else support.capped(plan, 0)


def _run_step(dc: Engine, kind: str, data, plan: StepPlan) -> float:
    rank = dist.get_rank()
    if kind in SUPPORT_KINDS:
        return support.run_rank_step(dc, data, plan, rank)
    return adapter_step(dc, plan, data, adapter_models.item)


def case_sharded_parity(
    kind: str, shard_size: int, seeds: list[int], num_samples: int, recompute: list[bool], max_norm_frac: float = 0.5
) -> list[dict]:
    """One engine with ``shard_size``, a step per seed (plans of whole shard blocks: modes in
    `MODES` order, recompute random or off); per step the loss, the full gradients, then
    `clip_grad_norm_` to ``max_norm_frac`` of the norm: its returned norm and the clipped
    full gradients."""
    dc = _engine(kind, shard_size)
    out = []
    for i, seed in enumerate(seeds):
        data = _data(kind, num_samples, seed)
        plan = _plan(dc, kind, data, num_samples, seed, MODES[i % len(MODES)], recompute[i], shard_size)
        dc.check_plan(plan)
        loss = _run_step(dc, kind, data, plan)
        grads = dc.full_gradients()
        norm0 = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())))
        norm = dc.clip_grad_norm_(max_norm_frac * norm0)
        clipped = dc.full_gradients()
        out.append(
            {
                "loss": loss,
                "grads": grads,
                "norm": norm,
                "max_norm": max_norm_frac * norm0,
                "clipped": clipped,
                "plan": plan.to_json(),
                "count": dc.last_count,
            }
        )
    return out


def case_sharded_steps(
    kind: str, shard_size: int, seed: int, num_samples: int, num_steps: int, scheduler: bool
) -> dict:
    """``num_steps`` optimizer steps (lr 1e-2, weight decay 0.1 on matrices) over plans of
    whole blocks of 2 (valid for shard_size 1 and 2); optionally a StepLR halving lr each step.
    The parameters afterwards (whole), and the lr of every step."""
    dc = _engine(kind, shard_size)
    opt = dc.optimizer(lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    lrs = []
    for step in range(num_steps):
        data = _data(kind, num_samples, seed + step)
        plan = _plan(dc, kind, data, num_samples, seed + step, MODES[step % len(MODES)], True, 2)
        _run_step(dc, kind, data, plan)
        lrs.append(opt.param_groups[0]["lr"] if shard_size > 1 else opt.lr)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    params = {}
    for n, p in dc.model.named_parameters():
        params[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return {"params": params, "lrs": lrs}


def case_refusals(kind: str) -> dict:
    """Bad shard sizes and plans that split a block are refused with ValueError before any
    collective runs; returns the messages."""
    msgs = {}
    for s in (3, 8):
        try:
            _engine(kind, s)
        except ValueError as e:
            msgs[f"shard_size={s}"] = str(e)
    dc = _engine(kind, 2)
    world = dist.get_world_size()
    data = _data(kind, 4, 0)
    # SP 1 groups: each rank its own group (the rule needs SP >= 2 and aligned blocks)
    groups = tuple(GroupPlan((r,), (MicroBatch((r,), Layout(1, 1)),) if r < 4 else (), 0) for r in range(world))
    plan = StepPlan(0, tuple(range(world)), groups, sum(int(data.docs[s].shape[0]) for s in range(world)))
    try:
        dc.check_plan(plan)
    except ValueError as e:
        msgs["plan"] = str(e)
    try:
        plan.check_shard_blocks(2)
    except ValueError as e:
        msgs["StepPlan.check_shard_size"] = str(e)
    # a group of 2 that is not aligned on a block: ranks (1, 2)
    from dcparallel.runtime.sharded import check_group

    try:
        check_group((1, 2), 2)
    except ValueError as e:
        msgs["unaligned"] = str(e)
    return msgs


def case_storage(shard_size: int) -> dict:
    """Bytes of parameter and gradient storage this rank holds for the reference DiT."""
    dc = _engine("dit", shard_size)
    if shard_size > 1:
        return dc.grad_sync.storage_bytes()
    return {
        "params": dc.flat_param.numel() * dc.flat_param.element_size(),
        "grads": dc.flat_grad.numel() * dc.flat_grad.element_size(),
    }


def case_bf16_step(seed: int, num_samples: int, shard_size: int = 2) -> dict:
    """The reference DiT in bf16 (shard_size 2: fp32 sharded parameters, bf16 compute, fp32
    gradients); the loss and full gradients of one step of whole blocks of 2."""
    model = support.make_model("dit").to(torch.bfloat16)
    dc = Engine(model, layers=model.layers, num_heads=support.NUM_HEADS, shard_size=shard_size)
    data = support.make_data("dit", num_samples, seed)
    for k in list(data.docs):
        data.docs[k] = data.docs[k].to(torch.bfloat16)
    plan = _plan(dc, "dit", data, num_samples, seed, "world", True, 2)
    loss = _run_step(dc, "dit", data, plan)
    grads = dc.full_gradients()
    return {
        "loss": loss,
        "grads": grads,
        "param_dtypes": sorted({str(p.dtype) for p in dc.model.parameters()}),
        "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
    }


def _optimizer_step(dc: Engine, opt, kind: str, num_samples: int, seed: int) -> None:
    """A step of a random plan (whole blocks of 4, or of the world when smaller: valid at
    every shard size) and its optimizer step."""
    data = _data(kind, num_samples, seed)
    plan = _plan(dc, kind, data, num_samples, seed, "random", True, min(4, dist.get_world_size()))
    _run_step(dc, kind, data, plan)
    opt.step()
    opt.zero_grad()


def case_sharded_resume(kind: str, shard_size: int, path: str, save: bool, seed: int = 5, num_samples: int = 6) -> dict:
    """``save``: a step and an optimizer step at ``shard_size``, `save_sharded` into ``path``,
    then a second step. Else: a fresh engine at ``shard_size`` loads ``path`` and runs the
    second step. The whole parameters after the second step (plans of whole blocks of 4, or of
    the world when smaller: valid at every shard size), and ``buffer/updates``, a persistent
    buffer each optimizer step changes alike on every rank (saved once, loaded by every rank)."""
    from dcparallel.runtime.sharded_checkpoint import load_sharded, save_sharded

    dc = _engine(kind, shard_size)
    dc.model.register_buffer("updates", torch.zeros(3))
    opt = dc.optimizer(lr=1e-2, weight_decay=0.1)
    steps = [0, 1] if save else [1]
    if not save:
        load_sharded(path, dc, opt)
    for step in steps:
        _optimizer_step(dc, opt, kind, num_samples, seed + step)
        dc.model.updates.add_(torch.arange(3.0) + step + 1)
        if save and step == 0:
            save_sharded(path, dc, opt)
    out = {n: p.full_tensor().detach().clone() for n, p in dc.model.named_parameters()}
    return {**out, "buffer/updates": dc.model.updates.clone()}


def case_loader_shard_rule(num_samples: int = 24, seed: int = 0) -> dict:
    """A loader planning for a cluster with shard_size 2 (the dcp policy, a dataset whose short
    samples fit one rank): every step plan it yields has SP groups of whole blocks, or it
    refuses the first that does not with ValueError (the same on every rank) — never a plan
    that would hang a sharded engine."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.data import DataCentricLoader
    from dcparallel.plan.types import splits_shard_block
    from tests.dist.loader_cases import TINY_SPEC, ArithmeticTokens, tiny_cluster

    world = dist.get_world_size()
    dataset = ArithmeticTokens(num_samples, seed)
    cluster = tiny_cluster(world, shard_size=2)
    loader = DataCentricLoader(
        dataset,
        dataset.lengths,
        cost=AnalyticCost(TINY_SPEC, cluster),
        cluster=cluster,
        policy="dcp",
        tokens_per_step=1200,
        seed=seed,
        planning="thread",  # the planning process makes the same plans (test_plan_process), a process per rank
    )
    groups = []
    try:
        for step in loader:
            groups += [tuple(g.ranks) for g in step.plan.groups]
    except ValueError as e:
        return {"error": str(e), "groups": groups}
    return {"error": None, "groups": groups, "split": [g for g in groups if splits_shard_block(g, 2)]}


def case_cross_format_resume(
    kind: str, shard_size: int, root: str, save: bool, seed: int = 5, num_samples: int = 6, per_rank: bool = False
) -> dict:
    """Through the training loop's checkpoint functions (`apps.train_checkpoint`):
    ``save``: a step and an optimizer step at ``shard_size``, the checkpoint of step 1 under
    ``root`` (``per_rank``: in dcparallel 0.1's per-rank format instead, `tests.checkpoint_v1`,
    shard_size 1 only), then a second step. Else: a fresh engine at ``shard_size`` loads the
    newest checkpoint and runs the second step. The whole parameters after the second step."""
    from types import SimpleNamespace

    from dcparallel import checkpoint
    from dcparallel.apps import train_checkpoint

    dc = _engine(kind, shard_size)
    run = SimpleNamespace(shard_size=shard_size, model=dc.model, engine=dc)
    opt = dc.optimizer(lr=1e-2, weight_decay=0.1)
    steps = [0, 1] if save else [1]
    if not save:
        train_checkpoint.load(checkpoint.latest(root), run, opt)
    for step in steps:
        _optimizer_step(dc, opt, kind, num_samples, seed + step)
        if save and step == 0 and per_rank:
            _save_per_rank(root, dc, opt)
        elif save and step == 0:
            train_checkpoint.save(Path(root), 1, run, opt, {"loader": {}}, keep=2)
    return {n: (p.full_tensor() if shard_size > 1 else p).detach().clone() for n, p in dc.model.named_parameters()}


def _save_per_rank(root: str, dc: Engine, opt) -> None:
    """Step 1's checkpoint as dcparallel 0.1's `dcparallel train` wrote it with shard_size 1."""
    from dcparallel import checkpoint
    from tests.checkpoint_v1 import save_per_rank

    state = opt.state_dict()
    payload = {"optimizer": state, "rng": checkpoint.rng_state()}
    if dist.get_rank() == 0:
        payload["model"] = dc.model.state_dict()
    save_per_rank(root, 1, payload, {"loader": {}}, optimizer_range=(state["start"], state["stop"]))


def _count_reduce_scatters(run) -> tuple[object, int]:
    """``run()``'s result and how many reduce-scatters it issued (FSDP's, on any group)."""
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    count = [0]

    def wrap(fn):
        def call(*args, **kwargs):
            count[0] += 1
            return fn(*args, **kwargs)

        return call

    for n, fn in originals.items():
        setattr(dist, n, wrap(fn))
    try:
        return run(), count[0]
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def _forward_only(dc: Engine, data, plan: StepPlan, rank: int, backward: bool = False) -> None:
    """This rank's micro-batches of ``plan``, every one announced as not the step's last."""
    for mb, ranks in plan.work_of(rank):
        batch = text_batch(mb, ranks, rank, data.docs, data.labels)
        with dc.micro_batch(batch, last=False) as ctx:
            ptl, _ = per_token_loss(dc.model(batch.inputs, batch.positions), batch.labels)
            loss = ctx.token_loss(ptl, batch.loss_mask)
            if backward:
                ctx.backward(loss)


def case_grad_hold(shard_size: int, seeds: list[int], num_samples: int) -> list[dict]:
    """One sharded Llama; an evaluation first (no_grad micro-batches announced as not the
    last, with the hold on: nothing held, so zero_grad and idle ranks' syncs go on); per seed
    the same step twice, FSDP's gradient sync on in every micro-batch, then held off until the
    last (`ShardedGrads.set_accumulate_unsharded`): reduce-scatters counted, losses and full
    gradients of both; then a step whose last micro-batch is announced as not the last, with
    the gradients held: its error."""
    dc = _engine("llama", shard_size)
    rank = dist.get_rank()

    def block_plan(data):  # every micro-batch over whole shard blocks
        return support.random_plan(
            data,
            list(range(num_samples)),
            dist.get_world_size(),
            0,
            num_layers=dc.adapter.spec.num_layers,
            sizes=(shard_size,),
            min_size=shard_size,
        )

    data = _data("llama", num_samples, seeds[0])
    plan = block_plan(data)
    dc.grad_sync.set_accumulate_unsharded(True)
    with torch.no_grad():  # an evaluation (the trainer's): micro-batches announced as not the last hold nothing
        _forward_only(dc, data, plan, rank)
    dc.zero_grad()
    out = []
    for i, seed in enumerate(seeds):
        data = _data("llama", num_samples, seed)
        plan = _plan(dc, "llama", data, num_samples, seed, ("idle", "phases", "random")[i % 3], True, shard_size)
        res = {"num_mbs": len(plan.work_of(rank))}
        for hold in (False, True):
            dc.grad_sync.set_accumulate_unsharded(hold)
            loss, n = _count_reduce_scatters(lambda: support.run_rank_step(dc, data, plan, rank))
            res[hold] = {"loss": loss, "reduce_scatters": n, "grads": dc.full_gradients()}
        out.append(res)
    data = _data("llama", num_samples, seeds[0])
    plan = block_plan(data)
    _forward_only(dc, data, plan, rank, backward=True)
    try:
        dc.sync_gradients()
        out.append({"error": None, "ran": bool(plan.work_of(rank))})
    except RuntimeError as e:
        out.append({"error": str(e), "ran": bool(plan.work_of(rank))})
    return out
