"""The one interface of the `dcp` portfolio's candidates (`Candidate`), what they propose
(`Proposal`) and what their gates read about a step (`StepFacts`, derived by the planner:
`portfolio.DcpPlanner`).

Short names: n (the step's samples), s (a `StepFacts`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple, Protocol

from dcparallel.plan.dcp.classes import ClassPlan
from dcparallel.plan.steps import Step
from dcparallel.plan.types import REL_TOL, StepPlan

#: the name of the class-level candidate on the chain alone (its proposal sets `StepFacts.chain_at`)
CHAIN = "chain"


class Proposal(NamedTuple):
    """A candidate's plan of a step and its predicted step seconds (the class level's own
    prediction for the class-level candidates, the score for the others)."""

    plan: StepPlan
    predicted: float


class Once:
    """A function of no arguments returning `make()`, computed on its first call only."""

    def __init__(self, make: Callable[[], Any]):
        self.make, self.value = make, None

    def __call__(self) -> Any:
        if self.value is None:
            self.value = self.make()
        return self.value


@dataclass(frozen=True)
class StepFacts:
    """What the portfolio's gates read about a step: its samples (`n`), the world, the
    class-level plan kept so far (None before candidate 0), the step's class-level bound and
    longest least micro-batch time (of candidate 0, on the degrees mixed), the chain's
    prediction over its own bound (0 where the chain is not planned apart), and, once the
    class level is done, the kept plan's score (taken when first asked)."""

    step: Step
    n: int
    world: int
    kept: ClassPlan | None = None
    bound: float = 0.0
    longest: float = 0.0
    chain_at: float = 0.0
    score: Once | None = None

    @property
    def predicted(self) -> float:
        """The kept class-level plan's prediction."""
        return self.kept.predicted

    def offered(self, name: str, got: ClassPlan) -> StepFacts:
        """The facts after class-level candidate `name` proposed `got`."""
        if self.kept is None:  # candidate 0, on the degrees mixed: the step's bound
            return replace(self, kept=got, bound=got.bound, longest=got.longest)
        chain_at = got.predicted / got.bound if name == CHAIN else self.chain_at
        faster = got.predicted < self.kept.predicted * (1 - REL_TOL)
        return replace(self, kept=got if faster else self.kept, chain_at=chain_at)


class Candidate(Protocol):
    """A planner of the portfolio: `runs` says whether it plans this step, `propose` plans it
    (None: no plan to offer)."""

    name: str

    def runs(self, facts: StepFacts) -> bool: ...

    def propose(self, facts: StepFacts) -> Proposal | None: ...


class ScoredCandidate(Candidate, Protocol):
    """A candidate compared by the score, with `floor`: no proposal of it is predicted below
    that (0.0: none known), so the portfolio skips it where the plan kept is no slower."""

    def floor(self, facts: StepFacts) -> float: ...
