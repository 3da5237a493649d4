"""`dcp` on a realistic mix of 200 distinct video shapes (`scenarios.MIXES["video-wide"]`):
every sample planned exactly once, every phase of every step tiling the world, and the same
plans in other processes (ranks plan independently, each with its own string hashing)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from dcparallel.scenarios import MIXES, SCENARIOS, distinct_shapes, sample_sizes
from tests.unit._models import check_dcp_epoch

WORLD = 64
STEPS = 2


def mix_200() -> tuple:
    """Every shape of the 200-shape mix once, then 1000 draws of it: 200 classes for the planner."""
    return tuple(MIXES["video-wide"].shapes()) + tuple(sample_sizes("video", "video-wide", num_samples=1000))


def plan_digest() -> str:
    """sha256 of the JSON of `dcp`'s plans of every step of `mix_200` on `WORLD` GPUs."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.plan.context import PlanContext
    from dcparallel.plan.policies import make_planner
    from dcparallel.plan.steps import form_steps
    from dcparallel.sim.replay import step_seconds
    from dcparallel.spec import Workload

    sc = SCENARIOS["video"]
    w, cl = Workload(sc.model, mix_200()), sc.cluster(WORLD)
    steps = form_steps(w.tokens, seed=0, tokens_per_step=sum(w.tokens) // STEPS)
    ctx = PlanContext(w, AnalyticCost(sc.model, cl), cl)
    planner = make_planner("dcp", ctx, steps, score=step_seconds(ctx))
    return hashlib.sha256(json.dumps([planner.plan(s).to_json() for s in steps]).encode()).hexdigest()


def test_plan_of_200_shapes_is_lossless_and_tiles_the_world():
    sc = SCENARIOS["video"]
    sizes = mix_200()
    assert distinct_shapes(sc.model, list(sizes)) == 200
    check_dcp_epoch(sc.model, sizes, sc.cluster(WORLD), seed=0, steps_per_epoch=STEPS)


def test_plan_of_200_shapes_is_the_same_in_other_processes():
    root = Path(__file__).resolve().parents[2]
    code = "from tests.unit.test_dcp_mixes import plan_digest; print(plan_digest())"
    out = set()
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(root))
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                           check=True, timeout=300)
        out.add(r.stdout.strip().splitlines()[-1])
    assert len(out) == 1 and len(next(iter(out))) == 64, out
