"""Reprice demo runs' micro-batches by a consensus of their profiles: is a policy's gap to its
price in the profile, or in training?

    PYTHONPATH=. .venv/bin/python benchmarks/demo_reprice.py /tmp/demo40/run1 /tmp/demo40/run2

Each folder is a `dcparallel demo` output of the same model and lengths (a fresh profile each).
The consensus prices every profile entry (bucket, SP degree, micro-batch size, recompute) at
its median over the profiles, each profile first divided by its overall speed (the median of
its entries over the consensus, iterated). Per run it prints each policy's busy time over its
price for the counted (median) timed run, by the run's own profile and by the consensus scaled
to that profile's speed, and the largest deviation of a policy from the pooled ratio. If the
policies stay apart under the consensus, the gap was in training, not in one profile's noise.
Needs each micro-batch's shape in real.json (``shapes``, which the demo logs).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from pathlib import Path

from dcparallel.apps.demo_predict import budget_cluster
from dcparallel.apps.demo_worker import shape_price, training_factor
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile

POLICIES = ("bucket", "packed", "dcp")


def repriced(run: dict, cost: ProfiledCost) -> dict:
    """A timed run with each micro-batch's price recomputed by `cost` from its logged shape."""
    return {
        "rank_steps": [
            [{**st, "priced": [shape_price(cost, sh) for sh in st["shapes"]]} for st in rank_steps]
            for rank_steps in run["rank_steps"]
        ]
    }


def consensus(profiles: list[Profile]) -> tuple[dict, list[float]]:
    """Per entry key, the median of the profiles' times after dividing each by its speed; the speeds."""
    tabs = [{(e.bucket, e.sp, e.mbs, e.recompute): e.time_s for e in p.entries if e.time_s} for p in profiles]
    common = set.intersection(*(set(t) for t in tabs))
    speed = [1.0] * len(tabs)
    for _ in range(4):
        cons = {k: statistics.median(t[k] / s for t, s in zip(tabs, speed)) for k in common}
        speed = [statistics.median(t[k] / cons[k] for k in common) for t in tabs]
    return cons, speed


def main(dirs: list[Path]) -> None:
    profiles = [Profile.load(d / "profile.json") for d in dirs]
    cons, speed = consensus(profiles)
    print("profile speeds against the consensus:", ", ".join(f"{d.name} {s:.3f}" for d, s in zip(dirs, speed)))
    for d, prof, s in zip(dirs, profiles, speed):
        real = json.loads((d / "real.json").read_text())
        cluster = budget_cluster(real)
        priced_by = copy.deepcopy(prof)
        for e in priced_by.entries:
            key = (e.bucket, e.sp, e.mbs, e.recompute)
            if e.time_s and key in cons:
                e.time_s = cons[key] * s
        cells = []
        for name, p in (("own profile", prof), ("consensus", priced_by)):
            cost = ProfiledCost(p, cluster)
            runs = {pol: repriced(real["policies"][pol], cost) for pol in POLICIES}
            ratio = {pol: training_factor([run]) for pol, run in runs.items()}
            pooled = training_factor(list(runs.values()))
            worst = max(abs(r / pooled - 1) for r in ratio.values())
            cells.append(
                f"{name}: "
                + " ".join(f"{pol} {r:.3f}" for pol, r in ratio.items())
                + f" (largest off the pooled {worst:.1%})"
            )
        print(f"{d.name}: " + " | ".join(cells))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main([Path(a) for a in sys.argv[1:]])
