"""The user-facing object: the ten lines of DESIGN.

    dc = dcparallel.DataCentricParallel(model, layers=model.layers, policy="dcp")
    loader = dc.prepare(dataset, lengths=dataset.lengths, tokens_per_step=2**20)
    opt = dc.optimizer(lr=3e-4)
    for step in loader:
        for batch in step:
            with dc.micro_batch(batch) as ctx:
                logits = model(batch.inputs, batch.positions)
                ctx.backward(ctx.token_loss(per_token_loss(logits, batch.labels), batch.loss_mask))
        dc.sync_gradients()
        opt.step()

`prepare` profiles the model at the launch's world size (or reuses a matching cached
profile), then returns the `DataCentricLoader` that plans every step with the policy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dcparallel.cost.profiled import ProfiledCost
from dcparallel.data.loader import DataCentricLoader, check_step_budget, read_sizes
from dcparallel.plan.policies import POLICIES
from dcparallel.profile.cache import load_or_profile
from dcparallel.profile.inputs import MakeInputs, reference_inputs, reference_spec
from dcparallel.profile.profiler import Profiler, ProfilerConfig, representative_sizes
from dcparallel.runtime import comm
from dcparallel.runtime import engine as _engine
from dcparallel.spec import ClusterSpec, ModelSpec

log = logging.getLogger(__name__)


def _default_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, _local_world()))


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size()))


class DataCentricParallel(_engine.DataCentricParallel):
    """`runtime.engine.DataCentricParallel` plus `prepare`: profile (cached) -> plan -> load.

    ``policy``: a name of `dcparallel.plan.policies.POLICIES`. ``memory_bytes``: usable memory
    per rank for model states and activations (default: 90% of the GPU; on CPU the machine's
    memory / local ranks). ``spec`` / ``make_inputs``: the planner's view of the model and a
    profiling-input builder; derived automatically for the reference models."""

    def __init__(self, model: nn.Module, *, layers: Sequence[nn.Module], policy: str = "dcp",
                 num_heads: int | None = None, memory_bytes: int | None = None, spec: ModelSpec | None = None,
                 make_inputs: MakeInputs | None = None, layers_per_unit: int | None = None,
                 gpus_per_node: int | None = None, seed: int = 0, **engine_kw: Any):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if spec is None:
            spec, unit = reference_spec(model, layers)
            layers_per_unit = layers_per_unit or unit
        heads = num_heads or spec.num_heads
        device = next(model.parameters()).device
        world = comm.world_size()
        self.memory_bytes = int(memory_bytes or _default_memory(device))
        g = gpus_per_node or min(_local_world(), world)
        self.cluster_spec = ClusterSpec(world_size=world, gpus_per_node=g, memory_bytes=self.memory_bytes,
                                        name=f"{device.type}x{world}")
        super().__init__(model, layers=layers, num_heads=heads, cluster=self.cluster_spec, seed=seed, **engine_kw)
        self.policy, self.spec = policy, spec
        self.layers_per_unit = layers_per_unit or 1
        self.make_inputs = make_inputs or reference_inputs(model, spec, device)
        self.profile = None
        self.cost = None

    def prepare(self, dataset: Any, *, lengths: Any, tokens_per_step: int | None = None,
                samples_per_step: int | None = None, profile_path: str | Path = "dcparallel_profile.json",
                profiler_config: ProfilerConfig | None = None, **loader_kw: Any) -> DataCentricLoader:
        """Profiles (or reuses the cached profile at ``profile_path``) and returns the loader.
        Call on every rank together (profiling is collective)."""
        check_step_budget(tokens_per_step, samples_per_step)  # before minutes of profiling
        sizes = read_sizes(lengths, len(dataset))
        config = profiler_config or ProfilerConfig(memory_limit=self.memory_bytes,
                                                   progress=comm.world_rank() == 0)
        profiler = Profiler(self.model, self.layers, self.make_inputs, spec=self.spec, config=config, engine=self,
                            layers_per_unit=self.layers_per_unit)
        self.profile, _ = load_or_profile(profile_path, profiler, representative_sizes(self.spec, sizes))
        self.cost = ProfiledCost(self.profile, self.cluster_spec)
        return DataCentricLoader(dataset, sizes, cost=self.cost, cluster=self.cluster_spec, policy=self.policy,
                                 tokens_per_step=tokens_per_step, samples_per_step=samples_per_step,
                                 seed=self.seed, **loader_kw)
