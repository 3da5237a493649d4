"""Gloo worker functions: a whole epoch of mixed-resolution video through the public API."""

from __future__ import annotations

import torch

from dcparallel.api import DataCentricParallel
from dcparallel.models.dit import DiT, DiTConfig
from tests.adapter_models import DIT_MIX, MIXES, VideoSet, build
from tests.dist.cases_common import epoch_per_policy

#: caption tokens per item: diffusers' Wan image-to-video attention takes the last 512 as text
TEXT = {"wan-i2v": 512}


def _model(kind: str):
    if kind == "dit":
        torch.manual_seed(0)
        return DiT(DiTConfig(num_layers=4, num_heads=4, hidden=32, freq_dim=16, attention="factorized"))
    return build(kind)


def case_video_epoch(kind: str, profile_path: str) -> dict:
    """Every policy trains one epoch (repeated shapes: 2 copies of the mix) at world 2 through
    `prepare` (profiled once, the cache reused by the other policies); per policy the
    (step, micro-batch) sample ids this rank ran and the losses."""
    shapes = (DIT_MIX if kind == "dit" else MIXES[kind]) * 2

    def setup(policy: str):
        model = _model(kind)
        dc = DataCentricParallel(
            model,
            policy=policy,
            research=True,
            memory_bytes=2**30,
            **({} if kind == "dit" else {"context_tokens": TEXT.get(kind, 5)}),
        )
        if kind == "dit":
            return model, dc, VideoSet(kind, shapes, model)
        return model, dc, [dc.adapter.sample(s, i) for i, s in enumerate(shapes)]

    return epoch_per_policy(setup, shapes, profile_path, kind)
