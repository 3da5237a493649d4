"""`dcp` planning cost per step as CPU time of this process (`time.process_time`), which other
jobs on a shared machine inflate far less than wall-clock time, with where the time goes.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_cpu_time.py --worlds 1024,4096 --budgets weak,strong \\
        [--cells text/short,video/video-mix,...] [--steps 4] [--profile]

Steps are timed as `dcparallel simulate` times them (`dcparallel.sim.run.PlanTiming`):
the planner's setup and its first step apart, then `--steps` steady-state steps (median
and maximum), in CPU time of this process. With `--repeats R` every cell is
planned in R rounds over all cells, each time with a fresh planner, and each step keeps its
least time: other jobs and slow spells of a shared machine only ever add time, and rounds
spread each cell's tries over the whole run. A fixed workload timed before each round
(`speed_probe`) shows how much the machine's speed moved.
A `dcp` plan holds its groups as arrays: each rank builds the objects of its own groups only
(`StepPlan.groups_of`, what the loader reads); the script times that for one rank, and the
building of every rank's objects (`StepPlan.groups`, what the simulator reads), after each
timed `plan(step)`.
Tail steps: an epoch's last step holds what is left of the shuffled order, a prefix of a
full step. After the steady steps, the same planner plans `--tails` such steps (default: the
first 1/2, 1/8 and 1/32 of the samples of a further full step), each timed the same way; the
report gives the slowest against the cell's steady median. The planner is built and tuned on
the whole epoch (its first, steady and tail steps), as `simulate` builds it. Each plan's
simulated step time (`sim.replay.step_seconds`) gives planning as a fraction of the step it
plans for: the loader plans a step while the one before trains, so below 1 it is hidden.
`--profile` plans the timed steps again under cProfile and splits the time into the
class-level search (`search.table` and `search.search`: candidate rows and the
batched passes over targets; `ClassLevelPlanner._plan_part`: group allocation), the expansion to
sample ids (`expand.expand`: dealing classes, cutting micro-batches, `refine`, `spill`),
building the plan objects (`expand.build_plan`:
`MicroBatch`, `GroupPlan`, `StepPlan`) and the rest (sorting the step's samples by bucket,
weights, the per-sample packing of `sample` where it runs).
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import statistics
import time

import numpy as np

from benchmarks.sim_scale import distributions
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step, form_steps
from dcparallel.scenarios import EPOCH_STEPS, SCENARIOS, sample_sizes
from dcparallel.sim.replay import step_seconds
from dcparallel.sim.run import PLAN_TIME_NOTE, timed_plans
from dcparallel.spec import Workload

PARTS = {
    "search": ("table", "search", "_plan_part"),
    "expand": "expand",
    "refine+spill": ("refine", "spill"),
    "objects": "build_plan",
}


def breakdown(prof: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds per part (refine+spill are inside expand; the rest is what the
    outermost `plan` calls spend outside the named parts)."""
    st = pstats.Stats(prof).stats
    cum: dict[str, float] = {}
    for (_, _, name), (_, _, _, ct, _) in st.items():
        cum[name] = cum.get(name, 0.0) + ct
    total = max((ct for (_, _, name), (_, _, _, ct, _) in st.items() if name == "plan"), default=0.0)
    out = {"total": total}
    for part, names in PARTS.items():
        names = (names,) if isinstance(names, str) else names
        out[part] = sum(cum.get(n, 0.0) for n in names)
    out["rest"] = total - out["search"] - out["expand"] - out["objects"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1024")
    ap.add_argument("--budgets", default="weak")
    ap.add_argument(
        "--cells",
        default=",".join(f"{s}/{d}" for s in SCENARIOS for d in distributions(s, "all")),
        help="scenario/distribution pairs (default: each scenario's distributions and realistic mixes)",
    )
    ap.add_argument("--steps", type=int, default=4, help="steady-state steps timed (after the first step)")
    ap.add_argument(
        "--tails",
        default="2,8,32",
        help="tail steps timed after the steady ones: 1/k of a further full step's samples, per k",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over all cells, each with fresh planners; each step keeps its least time "
        "(on a shared machine, other jobs only ever add time)",
    )
    args = ap.parse_args()
    cells = []
    tails: dict[str, list[Step]] = {}
    fractions = [int(k) for k in args.tails.split(",") if k]
    for budget in args.budgets.split(","):
        for world in [int(w) for w in args.worlds.split(",")]:
            for item in args.cells.split(","):
                sc_name, d = item.split("/")
                sc = SCENARIOS[sc_name]
                tps = sc.tokens_per_step * world // 32 if budget == "weak" else sc.tokens_per_step
                wl = Workload(
                    sc.model,
                    tuple(
                        sample_sizes(
                            sc_name, d, epoch_tokens=max(EPOCH_STEPS * sc.tokens_per_step, (args.steps + 2) * tps)
                        )
                    ),
                )
                cl = sc.cluster(world)
                ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
                steps = form_steps(wl.tokens, seed=0, tokens_per_step=tps)[: args.steps + 2]
                tails[f"{budget} {world} {item}"] = tail_steps(steps[args.steps + 1], fractions)
                cells.append((f"{budget} {world} {item}", ctx, steps[1 : args.steps + 1], steps[0]))
    cpu = {name: [math.inf] * len(steps) for name, _, steps, _ in cells}  # steady-state steps
    first = {name: math.inf for name, _, _, _ in cells}
    setup = {name: math.inf for name, _, _, _ in cells}
    own = {name: [math.inf] * len(steps) for name, _, steps, _ in cells}  # one rank's groups, built
    full = {name: [math.inf] * len(steps) for name, _, steps, _ in cells}  # every rank's groups, built
    tail = {name: [math.inf] * len(tails[name]) for name, *_ in cells}
    step_s: dict[str, tuple[list[float], list[float]]] = {}  # steady steps', tails' simulated seconds
    probes = []
    for _ in range(args.repeats):  # rounds over all cells, so a slow spell of the machine hits each cell once
        probes.append(speed_probe())
        for name, ctx, steps, first_step in cells:
            c0 = time.process_time()
            # tuned on the whole epoch, its short last step included, as `simulate` tunes
            planner = make_planner("dcp", ctx, [first_step, *steps, *tails[name]], score=step_seconds(ctx))
            setup[name] = min(setup[name], (time.process_time() - c0) * 1e3)
            # as `simulate` times them (`sim.run.timed_plans`): the first step apart, then the steady state
            plans, timing = timed_plans(planner.plan, [first_step, *steps])
            first[name] = min(first[name], timing.first_step_ms)
            for i, (plan, ms) in enumerate(zip(plans[1:], timing.steady_ms)):
                cpu[name][i] = min(cpu[name][i], ms)
                c0 = time.process_time()
                plan.groups_of(ctx.cluster.world_size // 2)  # what the loader of one rank reads
                own[name][i] = min(own[name][i], (time.process_time() - c0) * 1e3)
                c0 = time.process_time()
                _ = plan.groups  # every rank's GroupPlan objects (the simulator reads them)
                full[name][i] = min(full[name][i], (time.process_time() - c0) * 1e3)
            tail_plans, timing = timed_plans(planner.plan, tails[name])  # after the steady steps, as an epoch ends
            tail[name] = [min(a, b) for a, b in zip(tail[name], (timing.first_step_ms, *timing.steady_ms))]
            if name not in step_s:  # the simulator's step seconds (the same plans every round)
                score = step_seconds(ctx)
                step_s[name] = ([score(p) for p in plans[1:]], [score(p) for p in tail_plans])
    probes.append(speed_probe())
    print(
        f"speed probe (a fixed CPU workload, ms) before each round and after the last: "
        f"{', '.join(f'{x:.0f}' for x in probes)}",
        flush=True,
    )
    print(PLAN_TIME_NOTE, flush=True)
    for name, ctx, steps, first_step in cells:
        n = statistics.median(len(s.sample_ids) for s in steps)
        line = (
            f"{name}: {len(steps)} steps, {n} samples/step; "
            f"plan CPU ms median {statistics.median(cpu[name]):.1f} max {max(cpu[name]):.1f} "
            f"(first step {first[name]:.1f}, setup {setup[name]:.0f}); "
            f"one rank's groups built {statistics.median(own[name]):.2f} ms, "
            f"every rank's {statistics.median(full[name]):.1f} ms"
        )
        if tails[name]:
            line += "; tails " + ", ".join(
                f"{len(t.sample_ids)} samples {ms:.1f} ms" for t, ms in zip(tails[name], tail[name])
            )
            line += f" (slowest {max(tail[name]) / statistics.median(cpu[name]):.2f}x the median)"
        line += f"; planning / simulated step time: {fraction(cpu[name], tail[name], *step_s[name])}"
        if args.profile:
            planner = make_planner("dcp", ctx, [first_step, *steps, *tails[name]], score=step_seconds(ctx))
            planner.plan(first_step)
            prof = cProfile.Profile()
            for s in steps:
                prof.enable()
                planner.plan(s)
                prof.disable()
            b = breakdown(prof)
            line += "; profiled: " + ", ".join(f"{k} {100 * v / b['total']:.0f}%" for k, v in b.items() if k != "total")
        print(line, flush=True)
    for budget in args.budgets.split(","):
        for world in args.worlds.split(","):
            names = [name for name, *_ in cells if name.startswith(f"{budget} {world} ")]
            meds = [statistics.median(cpu[name]) for name in names]
            worst = max([max(cpu[n]) for n in names] + [max(tail[n], default=0.0) for n in names])
            print(
                f"{budget} {world}: median over its {len(meds)} cells {statistics.median(meds):.1f} ms, "
                f"slowest cell {max(meds):.1f} ms, slowest step (tails included) {worst:.1f} ms",
                flush=True,
            )
    return 0


def fraction(steady_ms: list[float], tail_ms: list[float], steady_s: list[float], tail_s: list[float]) -> str:
    """Planning CPU time over the simulated step time: the steady steps' median, the tails'
    largest (the loader plans a step while the one before trains: below 1 it is hidden)."""
    out = f"steady median {statistics.median(ms / (1e3 * s) for ms, s in zip(steady_ms, steady_s)):.4f}"
    if tail_ms:
        out += f", tails max {max(ms / (1e3 * s) for ms, s in zip(tail_ms, tail_s)):.4f}"
    return out


def tail_steps(step: Step, fractions: list[int]) -> list[Step]:
    """An epoch's possible last steps: the first 1/k of ``step``'s samples for each k (the
    tail of an epoch is what is left of the shuffled order, a prefix of a full step)."""
    ids = step.sample_ids
    return [Step(step.index, ids[: max(1, len(ids) // k)]) for k in fractions]


def speed_probe() -> float:
    """CPU ms of a fixed workload (a Python loop and a numpy sort): how fast the machine is
    running at the moment, to judge the timings' noise."""
    t = time.process_time()
    acc = 0
    for i in range(1_000_000):
        acc += i * i
    np.random.default_rng(0).random(1_000_000).sort()
    return (time.process_time() - t) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
