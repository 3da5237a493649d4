"""The static layouts as candidates of the `dcp` portfolio: the `bucket` and `packed`
baselines, tuned on the epoch's steps exactly as their own policies tune them
(`bucket.tune_static`), offer their plan of a step, scored like every other candidate.

Why: the class level plans each class's samples in micro-batches of their own, priced one
layout at a time. Where a micro-batch's fixed cost dominates (small models: a few million
parameters, most samples a few hundred tokens), one bin of documents of every length per
group is faster than many per-class micro-batches, and `packed` forms exactly that.
Offering the baselines' own plans makes the portfolio never predicted slower than either on
a step they are offered: the kept plan is the least scored, and the score is the simulator's
step time. They are offered on steps of at most `config.static_max_samples` samples: their
plans pack or deal the step sample by sample in Python (`packed`'s first fit,
`plan/binpack.py`, takes about 0.1 s on 27k text samples at 1024 GPUs and over a second on
75k images, whose bins of one shape are cut for memory sample by sample), and the
launch-bound regime is one of few samples per micro-batch. On video steps a layout whose
floor (`plan/static_floor.py`: its work over its groups, its longest micro-batch) is not
below the plan kept so far is not planned: it would not be kept (weak 1024-GPU video/long,
1,235 clips: 23 -> 16 ms a step).

Short names: s (the step's `candidate.StepFacts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from dcparallel.plan.bucket import BucketPlanner, tune_static
from dcparallel.plan.context import PlanContext
from dcparallel.plan.dcp.candidate import Proposal, StepFacts
from dcparallel.plan.dcp.config import DEFAULT
from dcparallel.plan.packed import PackedPlanner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import NoLayoutFits, Score


@dataclass
class StaticLayout:
    """One tuned static planner (`bucket` or `packed`) as a scored candidate of the portfolio:
    it runs on every step of at most `max_samples` samples (its plan is a packing or a deal
    of the step's samples, no search, but in Python per sample and bin)."""

    name: str
    #: the tuned planner (`plan.policies.Planner`)
    planner: Any
    max_samples: int
    #: what its plans are compared by (`plan.types.Score`)
    score: Score

    def runs(self, s: StepFacts) -> bool:
        return s.n <= self.max_samples

    def floor(self, s: StepFacts) -> float:
        """No plan of the step by this planner is predicted below this (`static_floor`)."""
        return self.planner.floor(s.step)

    def propose(self, s: StepFacts) -> Proposal:
        plan = self.planner.plan(s.step)
        return Proposal(plan, self.score(plan))


def static_layouts(
    ctx: PlanContext, steps: Sequence[Step], score: Score, max_samples: int = DEFAULT.static_max_samples
) -> list[StaticLayout]:
    """`bucket` and `packed`, each tuned as its policy tunes, on those of ``steps`` with at
    most ``max_samples`` samples (the steps they will be offered): none of a baseline that no
    single SP degree and recompute setting fits, and none without such steps (untuned, they
    would be a guess)."""
    steps = [s for s in steps if len(s.sample_ids) <= max_samples]
    if not steps:
        return []
    out = []
    for name, make in (("bucket", BucketPlanner), ("packed", PackedPlanner)):
        try:
            out.append(StaticLayout(name, tune_static(ctx, steps, make, score).planner, max_samples, score))
        except NoLayoutFits:
            continue
    return out
