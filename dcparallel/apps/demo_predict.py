"""The demo's predictions: each policy's run planned and simulated from the launch's profile.

The worker plans every policy once, right after profiling (`simulate_policies`: the
simulator's time of the epoch at the profile's prices, its idle share, the planner's
settings), prints them as the first result and stores them in ``real.json`` (``plans``).
`predict` turns them into predicted wall times at any point of the run: the simulated time
times the training factor measured so far (`demo_worker.training_factor`) plus one optimizer
step per training step; the worker prints it after every round, the orchestrator once at the
end, from the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence


def budget_cluster(real: dict):
    """The cluster a demo run trained on (real.json): its world on one node, its memory budget per rank."""
    from dcparallel.spec import ClusterSpec

    return ClusterSpec(
        world_size=real["world"],
        gpus_per_node=real["world"],
        memory_bytes=real["memory_budget_bytes"],
        name="cpu-budget",
    )


def simulate_policies(
    cost, cluster, lengths: Sequence[int], policies: Sequence[str], tokens_per_step: int, seed: int
) -> dict[str, dict]:
    """Per policy, its epoch planned (the steps formed as the demo's loader forms them) and
    simulated: ``sim_s`` (seconds at the profile's prices), ``idle_fraction``, ``settings``
    (the planner's, without its tuning times), ``steps``."""
    from dcparallel.plan.context import PlanContext
    from dcparallel.plan.steps import form_steps
    from dcparallel.sim.run import plan_epoch
    from dcparallel.spec import Workload

    ctx = PlanContext(Workload(cost.model, tuple(lengths)), cost, cluster)
    steps = form_steps(ctx.tokens, seed=seed, tokens_per_step=tokens_per_step)
    out = {}
    for name in policies:
        run = plan_epoch(ctx, steps, name)
        out[name] = {
            "sim_s": run.sim.total_time,
            "idle_fraction": run.sim.idle_fraction,
            "settings": {k: v for k, v in run.settings.items() if k != "tried_s"},
            "steps": len(steps),
        }
    return out


def predict(real: dict) -> dict[str, dict]:
    """Predicted wall time of each policy's runs in ``real`` (real.json, or the worker's record
    so far): the simulated epoch (``plans``) times ``training_factor`` plus the optimizer step
    measured before training once per step (``wall_s``, left out while the factor is None;
    ``wall_s_profile``: at the profile's prices, unscaled); with the profile's and the runs'
    reference times, the machine's speed during the runs against the profile's (``speed``) and
    the prediction at that speed."""
    factor = real["training_factor"]
    pred = {}
    for name, plan in real["plans"].items():
        optimizer = plan["steps"] * real["optimizer_step_s"]
        pred[name] = {
            "wall_s_profile": plan["sim_s"] + optimizer,
            "idle_fraction": plan["idle_fraction"],
            "settings": plan["settings"],
        }
        if factor is not None:  # None before the untimed runs measured it
            pred[name].update(wall_s=plan["sim_s"] * factor + optimizer, factor=factor)
        ref = real["policies"].get(name, {}).get("reference_s")
        if ref and real.get("profile_reference_s"):
            pred[name]["speed"] = ref / real["profile_reference_s"]
            pred[name]["wall_s_at_run_speed"] = pred[name]["wall_s_profile"] * pred[name]["speed"]
    return pred


def prediction_errors(pred: dict, real: dict, key: str) -> dict[str, float]:
    """Per policy with a prediction under `key`: abs(predicted - measured) / measured."""
    return {n: abs(pred[n][key] - v["wall_s"]) / v["wall_s"] for n, v in real["policies"].items() if key in pred[n]}
