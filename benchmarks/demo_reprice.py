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
Needs each micro-batch's shape in real.json (``shapes``, logged by the demo since b3bf31b).
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
from pathlib import Path

from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.spec import ClusterSpec, Recompute

POLICIES = ("bucket", "packed", "dcp")


def busy_and_priced(run: dict, cost: ProfiledCost) -> tuple[float, float]:
    """A timed run's micro-batch busy time and its price by `cost`, summed over ranks and steps."""
    busy = priced = 0.0
    for rank_steps in run["rank_steps"]:
        for st in rank_steps:
            busy += sum(b - a for a, b, *_ in st["segs"])
            priced += sum(cost.terms(tuple(lens), sp).time(Recompute(attn, mlp))
                          for lens, sp, attn, mlp in st["shapes"])
    return busy, priced


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
        cluster = ClusterSpec(world_size=real["world"], gpus_per_node=real["world"],
                              memory_bytes=real["memory_budget_bytes"], name="cpu-budget")
        priced_by = copy.deepcopy(prof)
        for e in priced_by.entries:
            key = (e.bucket, e.sp, e.mbs, e.recompute)
            if e.time_s and key in cons:
                e.time_s = cons[key] * s
        cells = []
        for name, p in (("own profile", prof), ("consensus", priced_by)):
            cost = ProfiledCost(p, cluster)
            parts = {pol: busy_and_priced(real["policies"][pol], cost) for pol in POLICIES}
            ratio = {pol: b / c for pol, (b, c) in parts.items()}
            pooled = sum(b for b, _ in parts.values()) / sum(c for _, c in parts.values())
            worst = max(abs(r / pooled - 1) for r in ratio.values())
            cells.append(f"{name}: " + " ".join(f"{pol} {r:.3f}" for pol, r in ratio.items())
                         + f" (largest off the pooled {worst:.1%})")
        print(f"{d.name}: " + " | ".join(cells))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main([Path(a) for a in sys.argv[1:]])
