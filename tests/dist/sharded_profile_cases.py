"""Gloo worker functions: `DataCentricParallel.prepare` with parameter-shard blocks (the
profiler measuring with FSDP2 on, the loader planning whole blocks) and ``shard_size="auto"``
(module level, for spawn)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from dcparallel.api import DataCentricParallel
from dcparallel.plan.types import splits_shard_block
from dcparallel.profile.profiler import ProfilerConfig
from tests import adapter_models, support

#: a tiny profiling run: one timed round per layout, micro-batches of 1 and 2, no recompute (the
#: sharded profile's claims do not depend on the mode; recompute under sharding: the parity tests)
CONFIG = ProfilerConfig(repeats=1, max_repeats=1, warmup=1, min_time_s=0.0, max_mbs=2, modes=("none",))
KIND, NUM_SAMPLES, SEED = "hf-llama", 12, 3


def _count_gathers(dc: DataCentricParallel, depth: int) -> int:
    """FSDP all-gathers (`FSDPParamGroup.unshard` calls) in one forward + backward of a stack
    of ``depth`` layers (`profile.measure.active_depth`): a skipped layer must gather nothing."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from dcparallel.profile.inputs import adapter_inputs
    from dcparallel.profile.measure import active_depth
    from dcparallel.profile.shards import compute_dtype
    from dcparallel.spec import Layout

    calls = [0]
    unshard = FSDPParamGroup.unshard

    def counted(self, *a, **k):
        calls[0] += 1
        return unshard(self, *a, **k)

    ranks = tuple(range(dist.get_world_size()))
    make = adapter_inputs(dc.model, dc.adapter, dc.loss_fn, dc.params[0].device, compute_dtype(dc.engine))
    inputs = make(8, Layout(len(ranks), 1), ranks, dist.get_rank())
    FSDPParamGroup.unshard = counted
    try:
        with active_depth(dc.layers, depth, dc.adapter.skip_block):
            with dc.micro_batch(inputs.batch) as ctx:
                ctx.backward(inputs.loss(ctx))
    finally:
        FSDPParamGroup.unshard = unshard
        dc.zero_grad()
    return calls[0]


def text_data(num_samples: int = NUM_SAMPLES, seed: int = SEED) -> support.Data:
    """Documents of 16..40 tokens (two profile buckets: a short profile), by sample id."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    docs = {i: torch.randint(0, adapter_models.VOCAB, (rng.randint(16, 40),), generator=g) for i in range(num_samples)}
    return support.Data(KIND, docs, {}, {}, {}, {i: tuple(d.shape) for i, d in docs.items()})


def case_prepare_sharded(shard_size: int, profile_path: str) -> dict:
    """A transformers Llama (GQA) wrapped with ``shard_size``; `prepare` profiles it at world 4
    with sharding on; the loader's first step runs and its loss and full gradients are kept;
    then the epoch trains with the optimizer. Returns the profile, the plans (and the groups
    that split a block: none expected), the first step's loss / gradients / sample ids, the
    losses and the FSDP all-gathers of a stack of 1 and of 2 layers."""
    data = text_data()
    dataset = [data.docs[i] for i in range(NUM_SAMPLES)]
    model = adapter_models.build(KIND)
    dc = DataCentricParallel(model, shard_size=shard_size, memory_bytes=2**30)
    loader = dc.prepare(
        dataset,
        lengths=[int(d.shape[0]) for d in dataset],
        tokens_per_step=240,
        profile_path=profile_path,
        profiler_config=CONFIG,
        planning="thread",  # the planning process makes the same plans (test_plan_process), a process per rank
    )
    gathers = {d: _count_gathers(dc, d) for d in (1, 2)}
    opt = dc.optimizer(lr=1e-3)
    plans, losses, first = [], [], None
    for step in loader:
        plans.append(step.plan.to_json())
        for batch in step:
            with dc.micro_batch(batch) as ctx:
                ctx.backward(dc.loss_fn(dc.model, batch, ctx))
        losses.append(dc.sync_gradients())
        if first is None:
            first = {"loss": losses[-1], "grads": dc.full_gradients(), "sample_ids": sorted(step.plan.sample_ids)}
        opt.step()
    splits = [
        g["ranks"]
        for p in plans
        for g in p["groups"]
        if g["micro_batches"] and splits_shard_block(g["ranks"], shard_size)
    ]
    return {
        "profile": dc.profile.to_json(),
        "plans": plans,
        "splits": splits,
        "first": first,
        "losses": losses,
        "gathers": gathers,
        "shard_size": dc.shard_size,
        "planned_state": dc.cost.model_state_bytes(),
        "held": dc.grad_sync.accumulate_unsharded,
    }


def reference_first_step(sample_ids) -> tuple[float, dict]:
    """The single-process loss and gradients of the unmodified model over ``sample_ids``."""
    return adapter_models.reference(adapter_models.build(KIND), text_data(), sample_ids)


def deep_dit(num_heads: int = 4):
    """A reference DiT of 8 thin layers: its layers hold most parameters, so sharding them
    saves more than the gathered layer costs (in a 2-layer model the gathered layer and the
    embeddings dominate and shard size 1 always needs least). Heads of width 8."""
    from dcparallel.models.dit import DiT, DiTConfig

    torch.manual_seed(0)
    return DiT(DiTConfig.tiny(num_layers=8, num_heads=num_heads, hidden=8 * num_heads, freq_dim=16))


def deep_dit_states(world: int, num_heads: int = 4) -> dict[int, float]:
    """The analytic model states per rank of `deep_dit` at shard sizes 1, 2 and 4 — what
    ``auto`` compares with the budget (`cost.base.model_state_bytes`)."""
    from dcparallel.adapters.find import find_adapter
    from dcparallel.cost.base import model_state_bytes

    spec = find_adapter(deep_dit(num_heads)).spec
    return {s: model_state_bytes(spec, world, s) for s in (1, 2, 4)}


def case_auto_shard_size_ring(budget: int) -> dict:
    """``DataCentricParallel(deep_dit(3), shard_size="auto", memory_bytes=budget)`` without and
    with ``ring``: per setting the shard size chosen, or the ValueError's message. (3 heads: no
    SP group of 2 or 4 ranks divides them; ring attention's groups need not.)"""
    out = {}
    for ring in (False, True):
        try:
            dc = DataCentricParallel(deep_dit(3), shard_size="auto", memory_bytes=int(budget), ring=ring)
            out[ring] = dc.shard_size
        except ValueError as e:
            out[ring] = str(e)
    return out


def case_auto_shard_size(budgets: list[int]) -> list[dict]:
    """Per budget, ``DataCentricParallel(deep_dit(), shard_size="auto", memory_bytes=budget)``:
    the shard size it chose, the class of its gradient state (`ShardedGrads` when sharded),
    its log lines about the choice — or the ValueError's message."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("dcparallel.runtime.auto_launch")  # `agreed_auto_shard_size` logs the choice
    handler, old = Keep(level=logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    out = []
    try:
        for budget in budgets:
            lines.clear()
            try:
                dc = DataCentricParallel(deep_dit(), shard_size="auto", memory_bytes=int(budget))
                out.append(
                    {
                        "shard_size": dc.shard_size,
                        "grads": type(dc.engine.grad_sync).__name__,
                        "log": [x for x in lines if "shard_size auto" in x],
                    }
                )
                try:  # a sample far too large for the budget: refused by prepare before profiling
                    shapes = [(1, 4, 4), (64, 256, 256)]
                    dc.prepare(list(range(2)), lengths=shapes, samples_per_step=2)
                except ValueError as e:
                    out[-1]["prepare_error"] = str(e)
            except ValueError as e:
                out.append({"error": str(e)})
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    return out
