"""Where `dcp`'s planning goes on steps of many distinct shapes, in counts that other jobs on
a shared machine do not move: Python function calls (cProfile) and, run under
`valgrind --tool=callgrind`, instructions.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_shapes.py --distribution video-mix --world 1024 \\
        --tokens-per-step 67108864 --steps 2 [--lengths FILE] [--profile]

The planner is built and plans one step untimed (the data's last step, so that runs with
different `--steps` share it), then plans the first `--steps` steps. With `--profile` the measured steps
run under cProfile: the total calls, and calls and cumulative share of the named stages.
For instruction counts run it under callgrind with `--callgrind`: instrumentation is off
until the measured steps (a small helper built with `cc` against valgrind's `callgrind.h`
switches it on and dumps the counts after them), so the dump `callgrind.out.*.1` holds the
instructions of the measured steps only (the cycle collector off: see `main`), and setup
runs at valgrind's uninstrumented speed:

    valgrind --tool=callgrind --instr-atstart=no python benchmarks/plan_shapes.py ... --callgrind
    callgrind_annotate callgrind.out.<pid>.1 | head   # "PROGRAM TOTALS": instructions; / --steps
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import pstats
import subprocess
import tempfile
import time
from pathlib import Path

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import SCENARIOS, distinct_shapes, read_lengths, sample_sizes
from dcparallel.sim.replay import step_seconds
from dcparallel.spec import Workload

#: the stages reported: (file suffix, function name)
STAGES = [
    ("dcp/search.py", "table"),
    ("dcp/search.py", "search"),
    ("dcp/search.py", "fits"),
    ("dcp/tables.py", "_build_rows"),
    ("dcp/classlevel.py", "_plan_part"),
    ("dcp/allocate.py", "allocate"),
    ("dcp/classes.py", "deal_classes"),
    ("dcp/classes.py", "class_span"),
    ("dcp/expand.py", "expand"),
    ("dcp/refine.py", "refine"),
    ("dcp/refine.py", "spill"),
    ("dcp/expand.py", "build_plan"),
    ("dcp/tables.py", "sort"),
    ("dcp/tables.py", "sample_weights"),
    ("dcp/sample.py", "plan"),
]


CALLGRIND_HELPER = r"""
#include <valgrind/callgrind.h>
void measure_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void measure_stop(void) { CALLGRIND_DUMP_STATS_AT("measured steps"); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def callgrind_helper() -> ctypes.CDLL:
    """`measure_start` / `measure_stop` from a shared library built from `CALLGRIND_HELPER`
    (outside valgrind the client requests do nothing)."""
    d = Path(tempfile.mkdtemp())
    (d / "cg.c").write_text(CALLGRIND_HELPER)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(d / "cg.so"), str(d / "cg.c")], check=True)
    return ctypes.CDLL(str(d / "cg.so"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="video")
    ap.add_argument("--distribution", default="video-mix")
    ap.add_argument("--lengths", default=None)
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--tokens-per-step", type=int, default=64 * 2**20)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--epoch-steps", type=int, default=4, help="steps' worth of samples drawn (not with --lengths)")
    ap.add_argument("--policy", default="dcp")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--callgrind",
        action="store_true",
        help="under valgrind --tool=callgrind --instr-atstart=no: count the measured steps only",
    )
    args = ap.parse_args()
    cg = callgrind_helper() if args.callgrind else None
    sc = SCENARIOS[args.scenario]
    sizes = (
        read_lengths(args.lengths)
        if args.lengths
        else sample_sizes(args.scenario, args.distribution, epoch_tokens=args.epoch_steps * args.tokens_per_step)
    )
    wl = Workload(sc.model, tuple(sizes))
    cl = sc.cluster(args.world)
    ctx = PlanContext(wl, AnalyticCost(sc.model, cl), cl)
    steps = form_steps(wl.tokens, seed=0, tokens_per_step=args.tokens_per_step)
    if len(steps) < args.steps + 1:
        raise SystemExit(f"error: {len(steps)} steps in the data, need --steps + 1 = {args.steps + 1}")
    measured, warm = steps[: args.steps], steps[-1]  # the same untimed step whatever --steps is
    c0 = time.process_time()
    planner = make_planner(args.policy, ctx, steps, score=step_seconds(ctx))
    planner.plan(warm)
    setup = time.process_time() - c0
    prof = cProfile.Profile() if args.profile else None
    c0 = time.process_time()
    if cg:
        # the cycle collector off: a full collection walks the whole heap (the workload, the
        # cost caches), so whether one lands in the measured steps depends on the process,
        # not on the planner, and would move the count by tens of millions
        gc.collect()
        gc.disable()
        cg.measure_start()
    for s in measured:
        if prof:
            prof.enable()
        planner.plan(s)
        if prof:
            prof.disable()
    if cg:
        cg.measure_stop()
    cpu = time.process_time() - c0
    shapes = [distinct_shapes(sc.model, [wl.sizes[i] for i in s.sample_ids]) for s in measured]
    print(
        f"{args.distribution if not args.lengths else args.lengths} world {args.world}: {len(wl)} samples, "
        f"{distinct_shapes(sc.model, list(wl.sizes))} shapes; steps of {[len(s.sample_ids) for s in measured]} "
        f"samples, {shapes} shapes; CPU s (noisy here): setup+first {setup:.2f}, per step "
        f"{cpu / max(1, len(measured)):.3f}"
    )
    if prof:
        st = pstats.Stats(prof).stats
        total = sum(cc for (cc, _, _, _, _) in st.values())
        top = max((ct for (f, _, n), (_, _, _, ct, _) in st.items() if n == "plan"), default=1e-9)
        print(f"cProfile: {total / len(measured):,.0f} calls per step")
        for suffix, name in STAGES:
            hits = [(cc, ct) for (f, _, n), (cc, _, _, ct, _) in st.items() if n == name and f.endswith(suffix)]
            if hits:
                cc, ct = sum(h[0] for h in hits), sum(h[1] for h in hits)
                print(f"  {suffix}:{name}: {cc / len(measured):,.0f} calls/step, {100 * ct / top:.0f}% cumulative")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
