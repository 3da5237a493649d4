"""RL steps on simulated H200: policies compared on rollouts as generated, and the cost of
planning each step at run time (`dc.plan_batch`).

    PYTHONPATH=. .venv/bin/python benchmarks/rl_steps.py [--steps 2] [--plan-steps 8] [--out benchmarks/rl_cpu_DATE.md]

The scenario is `dcparallel.sim.rl` (DAPO's long-reasoning lengths, steps in generation
order). Part 1: each policy plans each step on 64 and 1024 simulated H200 (Llama-3.1-8B,
analytic cost model), the simulator replays the plans; step seconds are the mean over the
steps. Part 2: what `plan_batch` adds to a step on 8, 64 and 1024 GPUs: the length
all-gather and the payload all-to-all, priced on the cluster's links from the bytes each
rank sends and receives under the `dcp` plan (input ids int64, three fp32 per-token tensors
and the bool loss mask: 21 bytes a token; a group's ranks each receive the whole rollout),
and the planning itself, measured here (CPU seconds of this process: the machine is shared,
and wall seconds there grow with the others' load) two ways over the same steps:
`RolloutPlanner.plan_step` as `plan_batch` runs it (one planner for the run, the layouts it
prices kept across steps), and a context + planner + plan built from scratch each step with
every candidate's tables (what `plan_batch` did before). Both give the same plans
(tests/unit/test_rollout_reuse.py). The first step of a run prices every layout it meets, so
planning is reported as the median over the steps and the first step's apart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import numpy as np
import torch

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.data.rollouts import routes
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.portfolio import FinerClasses
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
from dcparallel.runtime.rollout_step import RolloutPlanner
from dcparallel.scenarios import model_preset
from dcparallel.sim import rl
from dcparallel.sim.replay import replay_step, step_seconds
from dcparallel.spec import ClusterSpec, Workload, h200_cluster

POLICIES = ["dcp", "bucket", "packed", "megatron-dcp", "token-budget"]
#: rollouts per step: 16 prompts x 16 on 8 GPUs, 128 x 16 on 64, DAPO's 512 x 16 on 1024
ROLLOUTS = {8: 256, 64: 2048, 1024: 8192}
BYTES_PER_TOKEN = 8 + 3 * 4 + 1
MODEL = "llama-8b"


def compare(world: int, num_steps: int) -> list[dict]:
    n = ROLLOUTS[world]
    cluster = h200_cluster(world, 8)
    lengths = rl.rollout_lengths(n * num_steps)
    ctx = PlanContext(
        Workload(model_preset(MODEL), tuple(lengths)), AnalyticCost(model_preset(MODEL), cluster), cluster
    )
    steps = rl.rl_steps(n, num_steps)
    rows = []
    for policy in POLICIES:
        planner = make_planner(policy, ctx, steps, score=step_seconds(ctx))
        results = [replay_step(planner.plan(s), ctx) for s in steps]
        t = float(np.mean([r.step_time for r in results]))
        tokens = float(np.mean([r.num_tokens for r in results]))
        idle = float(np.mean([r.idle_gpu_s / (world * r.step_time) for r in results]))
        rows.append(
            {
                "world": world,
                "policy": policy,
                "step_s": t,
                "tok_s_gpu": tokens / t / world,
                "idle": idle,
                "violations": sum(r.memory_violations for r in results),
            }
        )
    base = next(r["step_s"] for r in rows if r["policy"] == "token-budget")
    for r in rows:
        r["speedup"] = base / r["step_s"]
    return rows


def alltoall_seconds(plan, owner: list[int], lengths: list[int], cluster: ClusterSpec) -> float:
    """The slowest rank's share of the payload all-to-all: bytes to (and from) its own node
    over NVLink, to (and from) other nodes over its NIC, one latency per peer."""
    w, g = cluster.world_size, cluster.gpus_per_node
    sends = routes(plan, owner, w)
    out = np.zeros((w, 2))
    inn = np.zeros((w, 2))
    peers = np.zeros(w)
    for src in range(w):
        for dst, ids in enumerate(sends[src]):
            if not ids or src == dst:
                continue
            b = sum(lengths[i] for i in ids) * BYTES_PER_TOKEN
            remote = int(src // g != dst // g)
            out[src, remote] += b
            inn[dst, remote] += b
            peers[src] += 1
    per = np.maximum(out, inn)
    lat = np.where(peers > 0, peers * cluster.inter_latency, 0.0)
    return float(np.max(per[:, 0] / cluster.intra_bw + per[:, 1] / cluster.inter_bw + lat))


def gather_seconds(n: int, cluster: ClusterSpec) -> float:
    """The length all-gather: a ring over the world of (length, targets) pairs, 16 bytes a rollout."""
    w = cluster.world_size
    return (w - 1) * cluster.inter_latency + 16 * n * (w - 1) / w / cluster.inter_bw


def from_scratch(lengths: list[int], k: int, cluster: ClusterSpec):
    """The step's plan as `plan_batch` planned it before it kept layouts: a new cost model,
    context and planner, the finer-classes tables built with the planner (as they were then,
    whether the step opens their gate or not); and its context."""
    cost = AnalyticCost(model_preset(MODEL), cluster)
    ctx = PlanContext(Workload(model_preset(MODEL), tuple(lengths)), cost, cluster)
    step = Step(k, tuple(range(len(lengths))))
    planner = make_planner("dcp", ctx, [step], score=step_seconds(ctx))
    for c in planner.candidates:
        if isinstance(c, FinerClasses):
            c.planner  # noqa: B018 - builds its tables now
    return planner.plan(step), ctx


def plan_cost(world: int, num_steps: int) -> dict:
    n = ROLLOUTS[world]
    cluster = h200_cluster(world, 8)
    planner = RolloutPlanner(
        AnalyticCost(model_preset(MODEL), cluster), cluster, "dcp", max_tokens=rl.RESPONSE_CAP + rl.PROMPT_CAP
    )
    lengths_all = rl.rollout_lengths(n * num_steps)
    owner = rl.generators(n, world)
    plan_s, scratch_s, a2a, step_s = [], [], [], []
    for k in range(num_steps):
        lengths = lengths_all[k * n : (k + 1) * n]
        t0 = time.process_time()
        plan, ctx = planner.plan_step(lengths, k)
        plan_s.append(time.process_time() - t0)
        t0 = time.process_time()
        again, _ = from_scratch(lengths, k, cluster)
        scratch_s.append(time.process_time() - t0)
        assert again == plan, f"step {k}: the planner keeping layouts planned differently"
        a2a.append(alltoall_seconds(plan, owner, lengths, cluster))
        step_s.append(replay_step(plan, ctx).step_time)
    return {
        "world": world,
        "rollouts": n,
        "steps": num_steps,
        "plan_s": float(np.median(plan_s)),
        "first_plan_s": plan_s[0],
        "scratch_s": float(np.median(scratch_s)),
        "gather_s": gather_seconds(n, cluster),
        "a2a_s": float(np.mean(a2a)),
        "step_s": float(np.mean(step_s)),
    }


def report(rows: list[dict], costs: list[dict], num_steps: int, plan_steps: int, seconds: float) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        f"# RL steps planned at run time, simulated H200 ({today})",
        "",
        "Command: `PYTHONPATH=. .venv/bin/python benchmarks/rl_steps.py --steps "
        f"{num_steps} --plan-steps {plan_steps}` ({seconds:.0f} s).",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}. Simulated: "
        f"{MODEL}, analytic cost model (H200 calibration), `h200_cluster` (8 GPUs a node).",
        "",
        "Scenario: `dcparallel/sim/rl.py` — DAPO's long-reasoning run (arXiv:2503.14476: 16 responses a "
        "prompt, responses up to 20,480 tokens, prompts up to 2,048; log-normal shapes inside those bounds "
        "are ours, stated in the module), steps formed from rollouts in generation order. "
        f"{num_steps} steps per cell; rollouts per step: "
        + ", ".join(f"{n} on {w} GPUs" for w, n in ROLLOUTS.items())
        + ".",
        "",
        "## Policies (simulated step seconds, mean over the steps)",
        "",
        "| GPUs | policy | step s | tokens/s/GPU | idle | vs token-budget | memory violations |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['world']} | {r['policy']} | {r['step_s']:.2f} | {r['tok_s_gpu']:.0f} | {r['idle']:.1%} | "
        f"{r['speedup']:.2f}x | {r['violations']} |"
        for r in rows
    ]
    lines += [
        "",
        "`token-budget` is RL frameworks' dynamic batch size (`plan/research/token_budget.py`): one SP degree, "
        "full recompute, equal sample counts per data-parallel group, the same micro-batch count on every "
        "group. `megatron-dcp` is the reproduction of Megatron-Core's dynamic CP (`plan/research/peers.py`).",
        "",
        "## What `plan_batch` adds to a step (`dcp`)",
        "",
        f"Planning measured here over {plan_steps} consecutive steps: `plan_step` as `plan_batch` runs it "
        "(median, and the run's first step), and the same plans as `plan_batch` made them before it kept "
        "layouts across steps: from scratch each step, every candidate's tables built (median).",
        "",
        "| GPUs | rollouts | planning s | first step's planning s | planning s before | "
        "length all-gather s (modeled) | payload all-to-all s (modeled) | step s (simulated) | "
        "planning + exchange / step | the same before |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in costs:
        comm_s = c["gather_s"] + c["a2a_s"]
        lines.append(
            f"| {c['world']} | {c['rollouts']} | {c['plan_s']:.3f} | {c['first_plan_s']:.3f} | "
            f"{c['scratch_s']:.3f} | {c['gather_s']:.5f} | {c['a2a_s']:.4f} | {c['step_s']:.2f} | "
            f"{(c['plan_s'] + comm_s) / c['step_s']:.1%} | {(c['scratch_s'] + comm_s) / c['step_s']:.1%} |"
        )
    lines += [
        "",
        "Planning runs on every rank at once (each plans alone from the same lengths), on the CPU, while "
        "nothing else runs in the step: it is on the critical path, measured here as CPU seconds of one "
        "process on this machine. A step's planner is built on its own lengths (its classes are sized by "
        "the step's longest samples); what is kept across steps is the layouts priced for micro-batches of "
        "copies of one length, so a step prices only lengths no earlier step met, and the `dcp` portfolio "
        "builds its finer-classes tables only on steps that open that candidate's gate. The exchange times "
        "are priced from bytes on the links (NVLink 315 GB/s per GPU inside a node, 40 GB/s NIC per GPU "
        "between nodes, one latency per peer), not measured.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--plan-steps", type=int, default=8, help="steps over which planning is timed")
    ap.add_argument("--out", default=f"benchmarks/rl_cpu_{datetime.date.today().isoformat()}.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = [r for w in (64, 1024) for r in compare(w, args.steps)]
    costs = [plan_cost(w, args.plan_steps) for w in (8, 64, 1024)]
    text = report(rows, costs, args.steps, args.plan_steps, time.perf_counter() - t0)
    with open(args.out, "w") as f:
        f.write(text)
    with open(args.out.removesuffix(".md") + ".json", "w") as f:
        json.dump({"policies": rows, "plan_batch": costs}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
