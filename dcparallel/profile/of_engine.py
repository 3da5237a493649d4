"""The profile of a model wrapped by an `Engine`, as `DataCentricParallel.prepare` needs it:
measured over representative sizes of the dataset (collective), or the matching one cached."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dcparallel.adapters.base import LossFn
from dcparallel.cost.schema import Profile
from dcparallel.profile.cache import load_or_profile
from dcparallel.profile.inputs import adapter_inputs
from dcparallel.profile.profiler import Profiler, ProfilerConfig, representative_sizes
from dcparallel.profile.shards import compute_dtype, shard_size
from dcparallel.profile.vision import check_tower_shards, profile_tower
from dcparallel.runtime import comm
from dcparallel.runtime.engine import Engine
from dcparallel.spec import ModelSpec, VisionSize


def profile_engine(
    engine: Engine,
    spec: ModelSpec,
    loss_fn: LossFn | None,
    sizes: Sequence[Any],
    path: Path,
    profiler_config: ProfilerConfig | Mapping[str, Any] | None,
    memory_bytes: int,
) -> Profile:
    """The profile of ``engine``'s model at this launch over representative sizes of ``sizes``
    (collective), or the matching one cached at ``path``. ``profiler_config``: a
    ProfilerConfig, or a mapping of its fields over the quick defaults; the recompute modes the
    adapter does not support are left out. A vision-language model's language model is
    measured at its samples' token counts, then its tower per patch bucket (`profile_tower`)."""
    check_tower_shards(spec, shard_size(engine))
    sizes = [int(s) if isinstance(s, VisionSize) else s for s in sizes]
    buckets = representative_sizes(spec, sizes)
    config = profiler_config
    if isinstance(config, Mapping):
        odd = sorted(set(config) - {f.name for f in dataclasses.fields(ProfilerConfig)})
        if odd:
            raise ValueError(
                f"profiler_config names {odd}, which are not ProfilerConfig fields; give fields of "
                f"dcparallel.profile.ProfilerConfig (e.g. max_repeats, modes) or a ProfilerConfig"
            )
    if not isinstance(config, ProfilerConfig):
        config = ProfilerConfig.quick(
            max(spec.tokens(s) for s in buckets),
            **{"memory_limit": memory_bytes, "progress": comm.world_rank() == 0, **(config or {})},
        )
    supported = engine.adapter.recompute_modes
    config = dataclasses.replace(config, modes=tuple(m for m in config.modes if m in supported))
    device, dtype = engine.params[0].device, compute_dtype(engine)
    make_inputs = adapter_inputs(engine.model, engine.adapter, loss_fn, device, dtype)
    profiler = Profiler(
        engine.model,
        engine.layers,
        make_inputs,
        spec=spec,
        config=config,
        engine=engine,
        layers_per_unit=engine.adapter.blocks_per_layer,
    )
    profile, stats = load_or_profile(path, profiler, buckets)
    past = stats is not None and config.budget_s is not None and stats.seconds > config.budget_s
    return profile_tower(profile, spec, engine.model, path, engine.zero_grad, past)
