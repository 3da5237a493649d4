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
from tests.adapter_models import build

ODD = (5, 6, 6)  # latent frames x height x width: 5 x 3 x 3 = 45 tokens, odd at SP 2


def ti2v_loss(model, batch, ctx):
    """Wan 2.2 TI2V's training step as a user writes it: per-token timesteps (B, N), the
    first latent frame clean (t = 0, the conditioning image), flow matching on the rest."""
    x0 = batch.inputs
    t = torch.stack([torch.sigmoid(torch.randn((), generator=ctx.generator(s))) for s in batch.sample_ids])
    noise = torch.stack([torch.randn(x0.shape[1:], generator=ctx.generator(s)) for s in batch.sample_ids])
    per_frame = t[:, None].expand(-1, x0.shape[2]).clone()
    per_frame[:, 0] = 0.0
    tb = per_frame[:, None, :, None, None]
    xt = (1 - tb) * x0 + tb * noise
    f, h, w = x0.shape[2:]
    timestep = (per_frame[:, :, None] * 1000).expand(-1, f, (h // 2) * (w // 2)).reshape(len(t), -1)
    pred = model(xt, timestep=timestep, encoder_hidden_states=batch.extras["encoder_hidden_states"],
                 return_dict=False)[0]
    return ctx.dense_loss((pred - (noise - x0)).pow(2).mean(1)[:, 1:])


def case_odd_length_memory() -> dict:
    """Profiles a Wan (per-token timesteps) on one odd-length latent shape at SP 1 and 2:
    the measured saved activations and the planner's memory from that profile."""
    model = build("wan")
    dc = Engine(model, adapter=find_adapter(model, context_tokens=5))  # text: 5 tokens, replicated
    make = adapter_inputs(model, dc.adapter, ti2v_loss, torch.device("cpu"))
    cfg = ProfilerConfig(repeats=1, warmup=1, max_mbs=1, min_time_s=0.0, modes=("none",))
    profile, _ = Profiler(model, dc.layers, make, spec=dc.adapter.spec, config=cfg, engine=dc).run([ODD])
    measured = {e.sp: e.memory_bytes for e in profile.entries if e.feasible and e.mbs == 1}
    cost = ProfiledCost(profile, ClusterSpec(world_size=2, gpus_per_node=2, memory_bytes=2**30))
    planned = {sp: mb_memory(cost, [ODD], Layout(sp, 1, Recompute.none())) for sp in (1, 2)}
    return {"measured": measured, "planned": planned, "tokens": dc.adapter.spec.tokens(ODD)}
