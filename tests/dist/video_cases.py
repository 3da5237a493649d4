"""Gloo worker functions: a whole epoch of mixed-resolution video through the public API."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dcparallel.api import DataCentricParallel
from dcparallel.models.dit import DiT, DiTConfig
from dcparallel.plan.policies import ALL
from dcparallel.profile.profiler import ProfilerConfig
from tests.adapter_models import DIT_MIX, MIXES, VideoSet, build


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
    config = ProfilerConfig(repeats=1, max_repeats=1, warmup=1, min_time_s=0.0, max_mbs=2, modes=("none", "full"))
    out = {}
    for policy in ALL:
        model = _model(kind)
        dc = DataCentricParallel(model, policy=policy, memory_bytes=2**30, **({} if kind == "dit" else
                                                                                {"context_tokens": TEXT.get(kind, 5)}))
        data = VideoSet(kind, shapes, model) if kind == "dit" else [dc.adapter.sample(s, i) for i, s in enumerate(shapes)]
        loader = dc.prepare(data, lengths=shapes, samples_per_step=8,
                            profile_path=profile_path, profiler_config=config)
        opt = dc.optimizer(lr=1e-3)
        ran, losses = [], []
        for step in loader:
            for batch in step:
                with dc.micro_batch(batch) as ctx:
                    ctx.backward(dc.loss_fn(model, batch, ctx))
                ran.append((step.index, batch.ranks, batch.sample_ids))
            losses.append(dc.sync_gradients())
            opt.step()
        out[policy] = {"ran": ran, "losses": losses, "num_samples": len(shapes), "rank": dist.get_rank()}
    return out
