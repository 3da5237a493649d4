"""Gloo worker functions for the structure-family parity tests (module level, for spawn)."""

from __future__ import annotations

from dcparallel.runtime.engine import Engine
from tests.dist.cases_common import PLAN_MODES, adapter_plan_steps
from tests.hf_structure_families import build, make_data


def case_family_engine(
    kind: str, seeds: list[int], num_samples: int, modes: tuple[str, ...] = PLAN_MODES
) -> list[dict]:
    """Random plans (SP 1/2/4, idle ranks, uneven counts, two phases, random recompute;
    ``modes`` in turn) of a transformers family driven through its adapter, as
    `adapter_cases.case_adapter_engine`."""
    return adapter_plan_steps(
        Engine(build(kind)),
        lambda seed: make_data(num_samples, seed),
        lambda data, s: data.docs[s],
        seeds,
        num_samples,
        modes,
    )
