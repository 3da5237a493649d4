"""The step former: which samples make each optimizer step. Shared by every policy.

The epoch's sample ids are shuffled by (seed, epoch); a step takes consecutive samples
until their tokens reach `tokens_per_step` (the sample that crosses the budget is included,
a sample larger than the budget is a step by itself) or `samples_per_step` samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    sample_ids: tuple[int, ...]


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def form_steps(
    tokens: Sequence[int],
    *,
    seed: int,
    epoch: int = 0,
    tokens_per_step: int | None = None,
    samples_per_step: int | None = None,
    ids: Sequence[int] | None = None,
) -> list[Step]:
    """Splits the epoch's shuffled samples into steps; every sample in exactly one step.

    `ids` restricts the epoch to those sample ids (e.g. after skipping oversize samples);
    the shuffle is of the full index range so the order of the rest does not change."""
    if (tokens_per_step is None) == (samples_per_step is None):
        raise ValueError("give exactly one of tokens_per_step or samples_per_step")
    if tokens_per_step is not None and tokens_per_step <= 0:
        raise ValueError(f"tokens_per_step must be > 0; got {tokens_per_step}")
    if samples_per_step is not None and samples_per_step <= 0:
        raise ValueError(f"samples_per_step must be > 0; got {samples_per_step}")
    order = epoch_order(len(tokens), seed, epoch)
    if ids is not None:
        keep = np.zeros(len(tokens), dtype=bool)
        keep[np.asarray(list(ids), dtype=np.int64)] = True
        order = order[keep[order]]
    steps: list[Step] = []
    current: list[int] = []
    acc = 0
    for i in order.tolist():
        current.append(i)
        acc += tokens[i]
        full = acc >= tokens_per_step if tokens_per_step is not None else len(current) >= samples_per_step
        if full:
            steps.append(Step(len(steps), tuple(current)))
            current, acc = [], 0
    if current:
        steps.append(Step(len(steps), tuple(current)))
    return steps
