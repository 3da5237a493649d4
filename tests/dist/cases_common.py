"""What the model-family parity and epoch tests share: on the workers, step plans run through a
model's adapter (`adapter_step`, on random plans: `adapter_plan_steps`) and an epoch per policy through the public
API (`epoch_per_policy`); in the test, the checks of their results against the single-process
reference (`assert_matches_reference`) and of a lossless epoch (`assert_lossless_epochs`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dcparallel.data.collate import resolve_collate
from dcparallel.plan.policies import ALL
from dcparallel.plan.types import MicroBatch
from dcparallel.profile.profiler import ProfilerConfig
from tests.support import random_plan, rel_err, train_steps

#: the random plans' modes, one per seed in turn: SP = world, idle ranks, random groups, phases
PLAN_MODES = ("world", "idle", "random", "phases")
#: the world-4 parity tests' modes: "phases" runs a group of the whole world (SP 4) between
#: narrow groups, one of them idle, so a plan of the whole world alone ("world": every rank
#: runs every micro-batch, the dearest plan) runs no code path these three do not
PARITY_MODES = ("idle", "random", "phases")
#: one quick profiling round (the epoch tests check what trains, not the timings)
EPOCH_PROFILE = ProfilerConfig(repeats=1, max_repeats=1, warmup=1, min_time_s=0.0, max_mbs=2, modes=("none", "full"))
#: `epoch_per_policy`'s profile of the kinds in `NO_FULL_RECOMPUTE`: no full-recompute layouts.
#: In 1 GiB no planner chooses one for them (with the none entries a profile measured, every
#: policy's epoch plans are the same with the full entries as without), and bucket-default's
#: plans recompute every layer either way, so full recompute still trains
EPOCH_PROFILE_NO_RECOMPUTE = dataclasses.replace(EPOCH_PROFILE, modes=("none",))
#: the epoch tests' kinds checked so: every kind `make test` runs, and the slow Wan look-alikes;
#: Flux 2's bucket-default plans change without the full entries, CogVideoX and Mochi are unchecked
NO_FULL_RECOMPUTE = frozenset(
    {"dit", "wan", "wan-i2v", "wan22-i2v", "ltx", "flux", "qwenimage", "hunyuan", "skyreels", "vace", "helios"}
)


def epoch_profile(kind: str) -> ProfilerConfig:
    """The profile `epoch_per_policy` measures for ``kind`` (see `NO_FULL_RECOMPUTE`)."""
    return EPOCH_PROFILE_NO_RECOMPUTE if kind in NO_FULL_RECOMPUTE else EPOCH_PROFILE


def adapter_step(dc: Any, plan: Any, data: Any, item: Callable[[Any, int], Any]) -> float:
    """This rank's micro-batches of ``plan``, collated from ``item(data, sample id)`` by the
    adapter's collate and run through its loss_fn, then the gradient sync: the step's loss."""
    rank = dist.get_rank()
    collate = resolve_collate(dc.adapter.collate, dc.adapter.kind)
    for mb, ranks in plan.work_of(rank):
        batch = collate({s: item(data, s) for s in mb.sample_ids}, MicroBatch(mb.sample_ids, mb.layout), ranks, rank)
        with dc.micro_batch(batch) as ctx:
            ctx.backward(dc.adapter.loss_fn(dc.model, batch, ctx))
    return dc.sync_gradients()


def adapter_plan_steps(
    dc: Any,
    make_data: Callable[[int], Any],
    item: Callable[[Any, int], Any],
    seeds: Sequence[int],
    num_samples: int,
    modes: Sequence[str] = PLAN_MODES,
) -> list[dict]:
    """Per seed a random plan of ``make_data(seed)`` (SP 1/2/4, idle ranks, uneven counts,
    phases, random recompute; ``modes`` in turn) run as `adapter_step`: the loss, every
    gradient and the plan."""
    results = []
    for i, seed in enumerate(seeds):
        data = make_data(seed)
        plan = random_plan(
            data,
            list(range(num_samples)),
            dist.get_world_size(),
            seed,
            num_layers=dc.adapter.spec.num_layers,
            mode=modes[i % len(modes)],
        )
        loss = adapter_step(dc, plan, data, item)
        grads = {n: p.grad.detach().clone() for n, p in dc.model.named_parameters()}
        results.append({"loss": loss, "grads": grads, "plan": plan.to_json()})
    return results


def epoch_per_policy(
    setup: Callable[[str], tuple[torch.nn.Module, Any, Any]], shapes: list, profile_path: str, kind: str
) -> dict:
    """Every policy trains one epoch of the samples of ``shapes`` through `prepare` (profiled
    once into ``profile_path`` as `epoch_profile` says for ``kind``, the cache reused by the
    other policies); ``setup(policy)`` ->
    (model, its DataCentricParallel, the dataset). Per policy the (step, group ranks, sample
    ids) this rank ran and the step losses. A policy whose epoch plans (`DataCentricLoader.plans`)
    are those of a policy trained before it trains nothing: the same model, data and plans run
    the same steps, so it gets that policy's results, marked ``same_as`` it."""
    out: dict[str, dict] = {}
    trained: dict[str, str] = {}  # an epoch's plans (JSON) -> the policy that trained them
    for policy in ALL:
        model, dc, data = setup(policy)
        # planned in a thread: the planning process makes the same plans (test_plan_process)
        # and would start a process per policy and rank
        loader = dc.prepare(
            data,
            lengths=shapes,
            samples_per_step=8,
            profile_path=profile_path,
            profiler_config=epoch_profile(kind),
            planning="thread",
        )
        plans = json.dumps([p.to_json() for p in loader.plans()])  # the same on every rank (one profile)
        if plans in trained:
            out[policy] = {**out[trained[plans]], "same_as": trained[plans]}
            continue
        trained[plans] = policy
        ran, losses, planned = [], [], []
        for step, loss in train_steps(dc, model, loader, dc.optimizer(lr=1e-3)):
            ran += [(step.index, batch.ranks, batch.sample_ids) for batch in step]
            planned.append(step.plan.to_json())
            losses.append(loss)
        assert json.dumps(planned) == plans, policy  # what ran is what was compared
        out[policy] = {"ran": ran, "losses": losses, "rank": dist.get_rank()}
    return out


def assert_matches_reference(
    out: list,
    i: int,
    ref_loss: float,
    ref_grads: dict,
    kind: str,
    seed: int,
    err: Callable = rel_err,
    same_on_ranks: bool = True,
) -> dict[str, float]:
    """Seed ``i`` of every rank's `adapter_plan_steps` results: the loss within 1e-5 of the
    reference's, the same gradients, each within 1e-5 by ``err(gradient, reference)`` and
    (``same_on_ranks``) equal on every rank. Returns each gradient's worst error."""
    plan = out[0][i]["plan"]
    worst: dict[str, float] = {}
    for r, res in enumerate(out):
        assert abs(res[i]["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (kind, r, seed, res[i]["loss"], ref_loss)
        assert set(res[i]["grads"]) == set(ref_grads)
        for name, g in res[i]["grads"].items():
            e = err(g, ref_grads[name])
            worst[name] = max(worst.get(name, 0.0), e)
            assert e <= 1e-5, f"{kind} rank {r} seed {seed} {name}: rel err {e:.2e} plan {plan}"
            if same_on_ranks:
                assert torch.equal(g, out[0][i]["grads"][name])
    return worst


def assert_lossless_epochs(out: list, shapes: list, grid: Callable[[int], Any]) -> None:
    """`epoch_per_policy`'s results of every rank, per policy: every rank of a micro-batch's
    group ran it, every sample exactly once in the epoch, every micro-batch of one latent grid
    (``grid(sample id)``), and every rank saw the same finite step losses."""
    for policy in ALL:
        runs: dict[tuple, set[int]] = {}
        for per_rank in out:
            for step, ranks, sids in per_rank[policy]["ran"]:
                runs.setdefault((step, tuple(ranks), tuple(sids)), set()).add(per_rank[policy]["rank"])
        assert all(ran == set(ranks) for (_, ranks, _), ran in runs.items()), policy
        trained = sorted(s for (_, _, sids) in runs for s in sids)
        assert trained == list(range(len(shapes))), (policy, trained)
        for _, _, sids in runs:
            assert len({grid(s) for s in sids}) == 1, (policy, [shapes[s] for s in sids])
        losses = out[0][policy]["losses"]
        assert losses == out[1][policy]["losses"] and all(math.isfinite(x) for x in losses)
