"""What the gloo workers of `test_dist_mixed_sizes` run (module level, so spawn pickles it by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.portfolio import DcpPlanner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import StepPlan
from dcparallel.runtime.engine import Engine
from dcparallel.runtime.groups import ProcessGroups
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import Workload, llama_like
from tests.support import capped, make_data, run_rank_step

#: six heads: SP 1, 2, 3 and 6 on one 6-GPU node, where 2 and 3 are not one chain
HEADS, LAYERS = 6, 3
#: planning lengths (tokens) for which `dcp` runs a group of 3 and a group of 2 side by side
#: on the node (the tiny planning model below, under the unit tests' 1.5 GiB budget)
MIXED_SIZES = (39442, 34951, 32261, 2464, 6670)
PLANNING_LM = llama_like("tiny-lm-6h", num_layers=4, hidden=384, num_heads=HEADS, ffn_hidden=1032, vocab_size=1000)


def six_head_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig.tiny(num_layers=LAYERS, num_heads=HEADS, hidden=48, ffn_hidden=64, vocab_size=64))


def mixed_plan(world: int) -> StepPlan:
    """`dcp`'s own plan of `MIXED_SIZES` on one node of `world` GPUs (its portfolio without the
    static layouts, whose one SP degree for the step would not mix sizes), its recompute
    capped at the test model's layers (the planning model has more)."""
    from tests.unit._models import cluster, cost

    cl = cluster(world, world)
    ctx = PlanContext(Workload(PLANNING_LM, MIXED_SIZES), cost(PLANNING_LM, cl), cl)
    step = Step(0, tuple(range(len(MIXED_SIZES))))
    return capped(DcpPlanner(ctx, step_seconds(ctx)).plan(step), LAYERS)


def case_mixed_step(seed: int) -> dict:
    """Every rank plans the step itself, runs its part on the groups the plan names, syncs:
    loss, gradients, plan."""
    plan = mixed_plan(dist.get_world_size())
    model = six_head_model()
    dc = Engine(model, layers=model.layers, num_heads=HEADS, groups=ProcessGroups(HEADS))
    data = make_data("llama", len(plan.sample_ids), seed)
    loss = run_rank_step(dc, data, plan, dist.get_rank())
    return {
        "loss": loss,
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "plan": plan.to_json(),
    }
