"""Every rank plans each step on its own, from the same inputs: `check_same_plan` compares
the ranks' plans of a step (a digest exchange on the control group), so that a rank whose plan
differs stops every rank with the step and the first difference instead of leaving its groups
waiting in a collective until the communication timeout."""

from __future__ import annotations

from dcparallel.plan.types import StepPlan
from dcparallel.runtime import comm

#: how often (steps) the ranks compare their plans by default: a digest exchange on the
#: control group costs about a millisecond, a divergent plan a hang until the NCCL timeout
CHECK_PLANS_EVERY = 50


def check_every(check_plans: int | bool) -> int:
    """``check_plans`` as a number of steps (True: 1, every step; False: 0, never)."""
    if isinstance(check_plans, float) or int(check_plans) < 0:
        raise ValueError(
            f"check_plans={check_plans!r}: give how often (in steps) the ranks compare their plans, "
            f"an int >= 0 (1: every step, 0: never)"
        )
    return int(check_plans)


def check_same_plan(plan: StepPlan, epoch: int, step: int) -> None:
    """Raises RuntimeError on every rank unless every rank holds this same plan (a digest
    exchange on the control group; on a mismatch one more to name the first difference)."""
    group = comm.control_group()
    mine = plan.to_json()
    digests = comm.all_gather_object(comm.digest(mine), group)
    if len(set(digests)) <= 1:
        return
    plans = comm.all_gather_object(mine, group)
    odd = next(r for r, d in enumerate(digests) if d != digests[0])
    same = [r for r, d in enumerate(digests) if d == digests[0]]
    raise RuntimeError(
        f"the plan of epoch {epoch} step {step} differs across ranks: ranks {same[:8]}"
        f"{' ...' if len(same) > 8 else ''} hold one plan, rank {odd} another; "
        f"{_first_difference(plans[0], plans[odd], 0, odd)}. Every rank plans on its own from the "
        f"same inputs (checked by DataCentricParallel.prepare): a different plan means the ranks' "
        f"inputs or planner versions differ (same dataset lengths, cost model, policy, seed and "
        f"dcparallel version on every rank)"
    )


def _first_difference(a: dict, b: dict, ra: int, rb: int) -> str:
    """Where two plans' JSON first differ, with both values (shortened)."""
    for key in ("step", "sample_ids", "num_tokens"):
        if a.get(key) != b.get(key):
            return f"{key}: rank {ra} has {str(a.get(key))[:120]}, rank {rb} has {str(b.get(key))[:120]}"
    ga, gb = a.get("groups", []), b.get("groups", [])
    for i, (x, y) in enumerate(zip(ga, gb)):
        if x != y:
            return f"group {i}: rank {ra} has {str(x)[:160]}, rank {rb} has {str(y)[:160]}"
    return f"groups: rank {ra} has {len(ga)}, rank {rb} has {len(gb)}"
