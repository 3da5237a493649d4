"""The RL scenario: steps of rollouts as a long-reasoning GRPO run generates them.

Lengths (prompt + response tokens) follow DAPO's published run (Yu et al., "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476, 2025): 512
prompts x 16 responses a step, responses up to 16,384 tokens plus a 4,096-token overlong
buffer (20,480 at most; longer generations are cut there), prompts up to 2,048 tokens. The
shape inside those bounds is ours, stated here: responses log-normal with a median of
`RESPONSE_MEDIAN` tokens and sigma `RESPONSE_SIGMA` (a long tail: about 1.6% are cut at the cap),
prompts log-normal with a median of 200 tokens. A step is the next rollouts in generation
order (no epoch-level shuffle or reordering: an RL step trains what was just generated),
and the rank that generated rollout i of a step of n on W ranks is ``i * W // n``.
"""

from __future__ import annotations

import numpy as np

from dcparallel.plan.steps import Step

RESPONSE_MEDIAN, RESPONSE_SIGMA, RESPONSE_CAP = 3000, 0.9, 16_384 + 4_096
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN, PROMPT_CAP = 200, 0.6, 32, 2_048
#: responses per prompt (GRPO's group)
GROUP = 16


def rollout_lengths(num: int, seed: int = 0) -> list[int]:
    """Tokens (prompt + response) of ``num`` rollouts in generation order: each prompt's
    `GROUP` responses one after another, sharing its prompt length."""
    rng = np.random.default_rng([seed, 55])
    prompts = np.clip(
        np.exp(rng.normal(np.log(PROMPT_MEDIAN), PROMPT_SIGMA, -(-num // GROUP))), PROMPT_MIN, PROMPT_CAP
    ).astype(np.int64)
    responses = np.minimum(np.exp(rng.normal(np.log(RESPONSE_MEDIAN), RESPONSE_SIGMA, num)), RESPONSE_CAP)
    return (np.repeat(prompts, GROUP)[:num] + np.maximum(responses.astype(np.int64), 1)).tolist()


def rl_steps(rollouts_per_step: int, num_steps: int) -> list[Step]:
    """Consecutive steps of the generated rollouts, in generation order."""
    n = rollouts_per_step
    return [Step(k, tuple(range(k * n, (k + 1) * n))) for k in range(num_steps)]


def generators(num: int, world_size: int) -> list[int]:
    """The rank that generated each of a step's ``num`` rollouts: the ranks generate
    consecutive shares, in rank order."""
    return [i * world_size // num for i in range(num)]
