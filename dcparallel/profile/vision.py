"""The vision tower of a vision-language model measured per image-patch bucket: one square
image of each bucket's patches encoded by the model's own tower (`adapters.vlm_families`'
``encode``), forward and backward where anything in it trains, timed (the median of
``repeats`` runs after a warm-up) and its activations kept for backward counted
(`measure.SavedTensorMeter`). The result is a `cost.vision.VisionTable`, which the cost model
fits to seconds and bytes per patch and per attention pair (`cost.vision.VisionPrice`).

It runs on a model whose tower and projectors hold no gradient (before wrapping or between
steps with gradients set to None; refused otherwise), and sets them back to None after every
run: a measurement never leaves a gradient behind for a training step to add. Grid-based
towers only (Qwen2-VL, Qwen2.5-VL, Qwen3-VL);
InternVL's fixed-size tiles have one patch count, so there is nothing to bucket.

`profile_tower` is what `DataCentricParallel.prepare` runs after the language model's
profile (`profile.of_engine`): where the adapter's spec has a tower and the profile holds no
table measured as the tower trains (trainable or frozen), rank 0 measures it, every rank
takes rank 0's table (the profile is the same on every rank), and rank 0 saves the profile
with it, so a cached profile brings it back. One timed run per bucket once the profile is
past its wall-time budget (``ProfilerConfig.budget_s``), three within it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from dcparallel.adapters.vlm_families import FAMILIES
from dcparallel.cost.schema import Profile
from dcparallel.cost.vision import VisionTable
from dcparallel.profile.measure import SavedTensorMeter
from dcparallel.runtime import comm
from dcparallel.spec import ModelSpec

#: patches per image of the default buckets: square grids from 16 x 16 to 64 x 64 patches
#: (images of about 224 to 900 pixels a side at Qwen2.5-VL's 14-pixel patches)
DEFAULT_PATCHES = (256, 1024, 2304, 4096)


def _module(model: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        model = getattr(model, part)
    return model


def square_grid(patches: int, merge: int) -> tuple[int, int, int]:
    """The (1, s, s) grid closest to ``patches``, ``s`` a positive multiple of ``merge``."""
    side = max(merge, merge * round(math.sqrt(patches) / merge))
    return 1, side, side


def measure_tower(model: nn.Module, patches: Sequence[int] = DEFAULT_PATCHES, repeats: int = 3) -> VisionTable:
    """The tower of ``model`` (a transformers vision-language class dcparallel trains) measured
    at one image of each bucket's patches (rounded to a square grid of whole merge blocks)."""
    name = type(model).__name__
    family = FAMILIES.get(name)
    vc = getattr(getattr(model, "config", None), "vision_config", None)
    if family is None or not hasattr(vc, "spatial_merge_size"):
        raise ValueError(
            f"{name} has no grid-based vision tower to measure per patch bucket (Qwen2-VL, Qwen2.5-VL, "
            f"Qwen3-VL have); plan its tower with the analytic cost model"
        )
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: measure each bucket at least once")
    tower = _module(model, family.tower)
    params = [p for path in (family.tower, *family.projectors) for p in _module(model, path).parameters()]
    projector = {id(p) for path in family.projectors for p in _module(model, path).parameters()}
    trainable = any(p.requires_grad for p in tower.parameters() if id(p) not in projector)  # as freeze_vision says
    if any(p.grad is not None for p in params):
        raise ValueError(
            f"the vision tower of {name} holds gradients; measure it with none (zero_grad(set_to_none="
            f"True), or before DataCentricParallel wraps the model): a measurement would add to them"
        )
    channels = getattr(vc, "in_channels", None) or vc.in_chans
    width = channels * vc.temporal_patch_size * vc.patch_size**2
    grids = sorted({square_grid(p, vc.spatial_merge_size) for p in patches}, key=lambda g: g[1])
    if len(grids) < 2:
        raise ValueError(
            f"patches {tuple(patches)} round to {len(grids)} distinct square grid(s); give two or more "
            f"buckets of different sizes"
        )
    seconds, kept = [], []
    for grid in grids:
        n = grid[0] * grid[1] * grid[2]
        pixels = torch.randn(n, width, generator=torch.Generator().manual_seed(n), dtype=torch.float32)
        grid_t = torch.tensor([grid], dtype=torch.long)
        times = [_run(model, family, pixels, grid_t, params) for _ in range(repeats + 1)][1:]  # after a warm-up
        seconds.append(statistics.median(times))
        meter = SavedTensorMeter(exclude=params)
        with meter:
            out = family.encode(model, pixels.to(next(tower.parameters()).device), grid_t)
        del out
        kept.append(float(meter.bytes))
    return VisionTable(tuple(g[1] * g[2] for g in grids), tuple(seconds), tuple(kept), trainable)


def _run(model: nn.Module, family, pixels: torch.Tensor, grid: torch.Tensor, params: list[nn.Parameter]) -> float:
    """Seconds of one forward (and backward where the output needs a gradient); no gradient
    left behind."""
    device = params[0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = family.encode(model, pixels.to(device), grid)
    if out.requires_grad:
        out.float().sum().backward()
    sync()
    took = time.perf_counter() - start
    for p in params:
        p.grad = None
    return took


def check_tower_shards(spec: ModelSpec, shard_size: int) -> None:
    """Refuses a model with a tower under parameter-shard blocks (``shard_size`` > 1), before
    anything is profiled: one rank cannot run a tower whose weights are sharded, and sharding
    has no parity test with a vision tower."""
    if spec.vision is not None and shard_size > 1:
        raise ValueError(
            f"{spec.name}: its vision tower is measured on one rank, which cannot run it with "
            f"parameters sharded in blocks of {shard_size}; use shard_size=1 with a vision-language "
            f"model (parameter sharding has no parity test with a vision tower)"
        )


def profile_tower(
    profile: Profile, spec: ModelSpec, model: nn.Module, path: Path, zero_grad, past_budget: bool
) -> Profile:
    """``profile`` with its model's tower measured (module docstring); collective, every rank.
    ``spec``: the adapter's (its `VisionTower`, trainable as the run trains); ``zero_grad``:
    the engine's, run after the measurement (its gradient hooks saw the tower's backward)."""
    from dcparallel.profile.cache import world_path

    tower = spec.vision
    if tower is None or (
        profile.vision is not None and profile.vision.trainable == tower.trainable and profile.model.vision == tower
    ):
        return profile
    error = table = None
    if comm.world_rank() == 0:
        try:
            table = measure_tower(model, repeats=1 if past_budget else 3)
        except Exception as exc:  # every rank raises it, none waits for a table that never comes
            error = f"{type(exc).__name__}: {exc}"
    zero_grad()
    table, error = comm.all_gather_object((table, error), comm.control_group())[0]
    if error is not None:
        raise ValueError(f"measuring the vision tower of {spec.name}: {error}")
    profile = dataclasses.replace(
        profile, model=dataclasses.replace(profile.model, vision=tower, extra_params=spec.extra_params), vision=table
    )
    if comm.world_rank() == 0:
        profile.save(path)
        profile.save(world_path(path, profile.world_size))
    comm.barrier(comm.control_group())
    return profile
