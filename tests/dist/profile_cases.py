"""Profiler functions the gloo workers run (module level so that spawn can pickle them)."""

from __future__ import annotations

import dataclasses

import torch

from dcparallel.models.llama import Llama, LlamaConfig
from dcparallel.profile import Profiler, ProfilerConfig, load_or_profile, model_spec, text_inputs
from tests.support import FakeClock, slow_measure


def tiny_profiler(make_inputs=None, **cfg) -> tuple[Profiler, Llama]:
    """A profiler of a 3-layer tiny Llama with one round per layout, ``cfg`` overriding its
    `ProfilerConfig`; ``make_inputs(model, inputs)`` wraps its input builder. Returns the model too."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, hidden=32, num_layers=3, num_heads=4, ffn_hidden=48))
    spec = model_spec(
        model,
        list(model.layers),
        name="tiny",
        kind="text",
        hidden=32,
        num_heads=4,
        ffn_hidden=48,
        attention="causal",
        vocab_size=64,
    )
    base = {"repeats": 1, "max_repeats": 1, "warmup": 1, "max_mbs": 2, "min_time_s": 0.0, "modes": ("none", "full")}
    config = ProfilerConfig(**{**base, **cfg})
    inputs = text_inputs(model, torch.device("cpu"))
    inputs = make_inputs(model, inputs) if make_inputs else inputs
    return Profiler(model, list(model.layers), inputs, spec=spec, config=config), model


def _profiler(**cfg) -> Profiler:
    return tiny_profiler(**cfg)[0]


def case_profile(path: str) -> dict:
    """An unlimited profile (cached at ``path``, then reused), and one under a fake memory
    limit that fits the 64-token bucket without recompute at SP=2 only."""
    prof = _profiler(validate=True)
    p, stats = load_or_profile(path, prof, [16, 40, 64])
    again, stats2 = load_or_profile(path, prof, [16, 40, 64])
    sp2 = next(e for e in p.entries if e.bucket == "t64" and e.sp == 2 and e.recompute == "none" and e.mbs == 1)
    limit = p.model_state_bytes + 1.01 * sp2.memory_bytes
    limited, lstats = _profiler(memory_limit=limit).run([16, 64])
    return {
        "profile": p.to_json(),
        "stats": dataclasses.asdict(stats),
        "reused": stats2 is None,
        "reused_same": again.to_json() == p.to_json(),
        "limit": limit,
        "limited": limited.to_json(),
        "limited_stats": dataclasses.asdict(lstats),
    }


def case_budget(budget_s: float) -> dict:
    """A profile whose measurements are made slow on a fake clock (`profile.budget._now`),
    rank 1's twice as slow as rank 0's: the SP 2 group agrees on how to measure each chain
    (else their collectives would not match) and each rank stops within the budget."""
    from dcparallel.profile import budget as budget_mod

    rank = torch.distributed.get_rank()
    clock = FakeClock()
    prof = _profiler(modes=("none", "attn", "full"), max_mbs=4, budget_s=budget_s, repeats=3, max_repeats=3)
    prof._measure = slow_measure(prof, clock, scale=1 + rank)
    saved, budget_mod._now = budget_mod._now, clock
    try:
        p, stats = prof.run([16, 32, 64, 128])
    finally:
        budget_mod._now = saved
    return {"profile": p.to_json(), "clock": clock.t, "stats": dataclasses.asdict(stats)}


def case_cpu_links(path: str) -> dict:
    """This launch's links timed for the analytic cost model (`profile.cpu_calibration.cpu_cluster`),
    then read back from the cache without timing."""
    from dcparallel.profile import cpu_calibration, cpu_links
    from dcparallel.spec import ClusterSpec

    gpu = ClusterSpec(world_size=2, gpus_per_node=2, intra_bw=1e10, inter_bw=1e10, name="cpu")
    min_s, cpu_links.MIN_S = cpu_links.MIN_S, 0.01  # short windows: the same code, a tenth of the time
    try:
        timed = cpu_calibration.cpu_cluster(gpu, path)
    finally:
        cpu_links.MIN_S = min_s
    measure, cpu_links.measure_links = cpu_links.measure_links, None  # a second timing would fail
    try:
        again = cpu_calibration.cpu_cluster(gpu, path)
    finally:
        cpu_links.measure_links = measure
    return {"timed": dataclasses.asdict(timed), "again": dataclasses.asdict(again)}
