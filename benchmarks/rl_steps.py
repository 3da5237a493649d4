"""RL steps on simulated H200: policies compared on rollouts as generated, and the cost of
planning each step at run time (`dc.plan_batch`).

    PYTHONPATH=. .venv/bin/python benchmarks/rl_steps.py [--steps 2] [--out benchmarks/rl_cpu_DATE.md]

The scenario is `dcparallel.sim.rl` (DAPO's long-reasoning lengths, steps in generation
order). Part 1: each policy plans each step on 64 and 1024 simulated H200 (Llama-3.1-8B,
analytic cost model), the simulator replays the plans; step seconds are the mean over the
steps. Part 2: what `plan_batch` adds to a step on 8, 64 and 1024 GPUs: the length
all-gather and the payload all-to-all, priced on the cluster's links from the bytes each
rank sends and receives under the `dcp` plan (input ids int64, three fp32 per-token tensors
and the bool loss mask: 21 bytes a token; a group's ranks each receive the whole rollout),
and the planning itself, measured here (wall seconds of this process: `PlanContext` +
planner + plan, as `RolloutPlanner.plan_step` runs them).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import numpy as np
import torch

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.data.rollouts import routes
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
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
    ctx = PlanContext(Workload(model_preset(MODEL), tuple(lengths)), AnalyticCost(model_preset(MODEL), cluster),
                      cluster)
    steps = rl.rl_steps(n, num_steps)
    rows = []
    for policy in POLICIES:
        planner = make_planner(policy, ctx, steps, score=step_seconds(ctx))
        results = [replay_step(planner.plan(s), ctx) for s in steps]
        t = float(np.mean([r.step_time for r in results]))
        tokens = float(np.mean([r.num_tokens for r in results]))
        idle = float(np.mean([r.idle_gpu_s / (world * r.step_time) for r in results]))
        rows.append({"world": world, "policy": policy, "step_s": t, "tok_s_gpu": tokens / t / world, "idle": idle,
                     "violations": sum(r.memory_violations for r in results)})
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


def plan_cost(world: int, num_steps: int) -> dict:
    n = ROLLOUTS[world]
    cluster = h200_cluster(world, 8)
    cost = AnalyticCost(model_preset(MODEL), cluster)
    lengths_all = rl.rollout_lengths(n * num_steps)
    owner = rl.generators(n, world)
    plan_s, a2a, step_s = [], [], []
    for k in range(num_steps):
        lengths = lengths_all[k * n:(k + 1) * n]
        t0 = time.perf_counter()
        ctx = PlanContext(Workload(model_preset(MODEL), tuple(lengths)), cost, cluster)
        step = Step(k, tuple(range(n)))
        plan = make_planner("dcp", ctx, [step], score=step_seconds(ctx)).plan(step)
        plan_s.append(time.perf_counter() - t0)
        a2a.append(alltoall_seconds(plan, owner, lengths, cluster))
        step_s.append(replay_step(plan, ctx).step_time)
    return {"world": world, "rollouts": n, "plan_s": float(np.median(plan_s)), "gather_s": gather_seconds(n, cluster),
            "a2a_s": float(np.mean(a2a)), "step_s": float(np.mean(step_s))}


def report(rows: list[dict], costs: list[dict], num_steps: int, seconds: float) -> str:
    today = datetime.date.today().isoformat()
    lines = [f"# RL steps planned at run time, simulated H200 ({today})", "",
             "Command: `PYTHONPATH=. .venv/bin/python benchmarks/rl_steps.py --steps "
             f"{num_steps}` ({seconds:.0f} s).", "",
             f"Machine: {platform.processor() or platform.machine()}, {platform.system()} {platform.release()}; "
             f"Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}. Simulated: "
             f"{MODEL}, analytic cost model (H200 calibration), `h200_cluster` (8 GPUs a node).", "",
             "Scenario: `dcparallel/sim/rl.py` — DAPO's long-reasoning run (arXiv:2503.14476: 16 responses a "
             "prompt, responses up to 20,480 tokens, prompts up to 2,048; log-normal shapes inside those bounds "
             "are ours, stated in the module), steps formed from rollouts in generation order. "
             f"{num_steps} steps per cell; rollouts per step: " +
             ", ".join(f"{n} on {w} GPUs" for w, n in ROLLOUTS.items()) + ".", "",
             "## Policies (simulated step seconds, mean over the steps)", "",
             "| GPUs | policy | step s | tokens/s/GPU | idle | vs token-budget | memory violations |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['world']} | {r['policy']} | {r['step_s']:.2f} | {r['tok_s_gpu']:.0f} | {r['idle']:.1%} | "
              f"{r['speedup']:.2f}x | {r['violations']} |" for r in rows]
    lines += ["", "`token-budget` is RL frameworks' dynamic batch size (`plan/token_budget.py`): one SP degree, "
              "full recompute, equal sample counts per data-parallel group, the same micro-batch count on every "
              "group. `megatron-dcp` is the reproduction of Megatron-Core's dynamic CP (`plan/peers.py`).", "",
              "## What `plan_batch` adds to a step (`dcp`)", "",
              "| GPUs | rollouts | planning s (measured here) | length all-gather s (modeled) | "
              "payload all-to-all s (modeled) | step s (simulated) | planning + exchange / step |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in costs:
        extra = c["plan_s"] + c["gather_s"] + c["a2a_s"]
        lines.append(f"| {c['world']} | {c['rollouts']} | {c['plan_s']:.3f} | {c['gather_s']:.5f} | "
                     f"{c['a2a_s']:.4f} | {c['step_s']:.2f} | {extra / c['step_s']:.1%} |")
    lines += ["", "Planning runs on every rank at once (each plans alone from the same lengths), on the CPU, while "
              "nothing else runs in the step: it is on the critical path, measured here as wall seconds of one "
              "process on this machine (median over the steps). The exchange times are priced from bytes on "
              "the links (NVLink 315 GB/s per GPU inside a node, 40 GB/s NIC per GPU between nodes, one latency "
              "per peer), not measured."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=f"benchmarks/rl_cpu_{datetime.date.today().isoformat()}.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = [r for w in (64, 1024) for r in compare(w, args.steps)]
    costs = [plan_cost(w, args.steps) for w in (8, 64, 1024)]
    text = report(rows, costs, args.steps, time.perf_counter() - t0)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
