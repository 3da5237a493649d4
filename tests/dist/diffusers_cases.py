"""Gloo worker functions for the diffusers memory test (module level, for spawn)."""

from __future__ import annotations

import torch

from dcparallel.adapters import find_adapter
from dcparallel.cost.base import mb_memory
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.profile import Profiler, ProfilerConfig
from dcparallel.profile.inputs import adapter_inputs
from dcparallel.runtime.engine import Engine
from dcparallel.spec import ClusterSpec, Layout, Recompute
from tests.adapter_models import build, wan_ti2v_loss

ODD = (5, 6, 6)  # latent frames x height x width: 5 x 3 x 3 = 45 tokens, odd at SP 2


def case_odd_length_memory() -> dict:
    """Profiles a Wan (per-token timesteps) on one odd-length latent shape at SP 1 and 2:
    the measured saved activations and the planner's memory from that profile."""
    model = build("wan")
    dc = Engine(model, adapter=find_adapter(model, context_tokens=5))  # text: 5 tokens, replicated
    make = adapter_inputs(model, dc.adapter, wan_ti2v_loss, torch.device("cpu"))
    cfg = ProfilerConfig(repeats=1, max_repeats=1, warmup=1, max_mbs=1, min_time_s=0.0, modes=("none",))
    profile, _ = Profiler(model, dc.layers, make, spec=dc.adapter.spec, config=cfg, engine=dc).run([ODD])
    measured = {e.sp: e.memory_bytes for e in profile.entries if e.feasible and e.mbs == 1}
    cost = ProfiledCost(profile, ClusterSpec(world_size=2, gpus_per_node=2, memory_bytes=2**30))
    planned = {sp: mb_memory(cost, [ODD], Layout(sp, 1, Recompute.none())) for sp in (1, 2)}
    return {"measured": measured, "planned": planned, "tokens": dc.adapter.spec.tokens(ODD)}
