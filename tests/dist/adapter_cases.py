"""Gloo worker functions for the adapter parity tests (module level, for spawn)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dcparallel.adapters import find_adapter
from dcparallel.plan.types import MicroBatch
from dcparallel.runtime.engine import Engine
from tests.adapter_models import build, item, make_data, wan_ti2v_loss
from tests.dist.cases_common import PLAN_MODES, adapter_plan_steps


def case_adapter_engine(
    kind: str, seeds: list[int], num_samples: int, modes: tuple[str, ...] = PLAN_MODES
) -> list[dict]:
    """Random plans (SP 1/2/4, idle ranks, uneven counts, two phases, random recompute;
    ``modes`` in turn) of a library model driven through its adapter: the collate, loss_fn
    and hooks the API uses."""
    model = build(kind)
    # the user's own module names its heads (the protocol); library models are read
    if kind == "custom":
        dc = Engine(model, num_heads=4, num_kv_heads=2)
    elif kind == "wan-ti2v":  # Wan 2.2 TI2V: the user's loss gives per-token timesteps
        dc = Engine(model, adapter=find_adapter(model, loss_fn=wan_ti2v_loss))
    else:
        dc = Engine(model)
    return adapter_plan_steps(dc, lambda seed: make_data(kind, num_samples, seed), item, seeds, num_samples, modes)


def case_refused_inside_sp(kind: str, inputs: dict) -> str:
    """One micro-batch at SP = world whose forward passes ``inputs`` (name -> "latents" for the
    batch's latents, else the value) that dcparallel refuses inside an SP group: the error."""
    from dcparallel.spec import Layout, Recompute

    world, rank = dist.get_world_size(), dist.get_rank()
    model = build(kind)
    dc = Engine(model)
    data = make_data(kind, 1, seed=5)
    batch = dc.adapter.collate(
        {0: item(data, 0)}, MicroBatch((0,), Layout(world, 1, Recompute.none())), tuple(range(world)), rank
    )
    extra = {k: batch.inputs if v == "latents" else v for k, v in inputs.items()}
    try:
        with dc.micro_batch(batch):
            model(
                batch.inputs,
                timestep=torch.zeros(1),
                encoder_hidden_states=batch.extras["encoder_hidden_states"],
                **extra,
            )
    except ValueError as exc:
        return str(exc)
    return "not refused"
