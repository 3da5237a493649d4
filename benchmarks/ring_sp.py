"""SP past the head count with Ulysses x ring, planned (`ClusterSpec.ring`): the plans of a
1M-token Llama-8B sample and of Wan 14B videos too long for its head limit, and `dcp`
against `megatron-dcp` and `bucket` on a mix with long samples, on simulated H200 nodes
(NVLink) and on nodes of PCIe-class links. Writes the report's tables (markdown) to stdout.

    PYTHONPATH=. .venv/bin/python benchmarks/ring_sp.py > benchmarks/ring-sp_cpu_2026-12-06.md
"""

from __future__ import annotations

import dataclasses
import platform
import random
import sys
import time

import numpy as np
import torch

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import Step
from dcparallel.plan.types import NoLayoutFits
from dcparallel.scenarios import MODEL_PRESETS
from dcparallel.sim.replay import step_seconds
from dcparallel.sim.run import run_policies
from dcparallel.spec import ClusterSpec, Workload, h200_cluster

POLICIES = ("dcp", "megatron-dcp", "bucket")
TOKENS_PER_STEP = 4_000_000


def pcie(world: int) -> ClusterSpec:
    """H200 nodes whose GPUs talk over PCIe-class links inside a node (25 GB/s one way, 20 us)."""
    return dataclasses.replace(h200_cluster(world), intra_bw=25e9, intra_latency=20e-6, name="pcie")


def long_mix(seed: int = 0) -> list[int]:
    """A text mix with long samples: 1M, 700k, 400k and 300k tokens among 200 of 2k-64k."""
    rng = random.Random(seed)
    return [1 << 20, 700_000, 400_000, 300_000] + [
        rng.choice([2048, 4096, 8192, 16384, 32768, 65536]) for _ in range(200)
    ]


def one_step(model, cluster: ClusterSpec, sizes) -> tuple[str, float] | None:
    """`dcp`'s plan of one step of ``sizes``: its busy micro-batches' SP and split, and its
    predicted seconds; None if a sample fits no layout."""
    try:
        ctx = PlanContext(Workload(model, tuple(sizes)), AnalyticCost(model, cluster), cluster)
    except NoLayoutFits:
        return None
    step = Step(0, tuple(range(len(sizes))))
    plan = make_planner("dcp", ctx, [step], score=step_seconds(ctx)).plan(step)
    return ", ".join(mb.layout.sp_words() for mb in plan.micro_batches()), step_seconds(ctx)(plan)


def single_cases() -> list[str]:
    rows = [
        "| model | sample | GPUs | Ulysses only: plan, step s | ring on: plan, step s |",
        "| --- | --- | ---: | --- | --- |",
    ]
    cases = [
        ("llama-8b", 1 << 20, 64),
        ("llama-8b", 1 << 20, 128),
        ("wan-14b", (321, 1088, 1920), 16),
        ("wan-14b", (641, 1088, 1920), 32),
    ]
    for name, size, world in cases:
        model = MODEL_PRESETS[name]
        cells = []
        for ring in (False, True):
            got = one_step(model, dataclasses.replace(h200_cluster(world), ring=ring), [size])
            cells.append("fits no layout" if got is None else f"{got[0]}, {got[1]:.2f}")
        rows.append(
            f"| {name} ({model.num_heads} heads) | {size} ({model.tokens(size):,} tokens) | {world} | "
            f"{cells[0]} | {cells[1]} |"
        )
    return rows


def mix_table() -> list[str]:
    model = MODEL_PRESETS["llama-8b"]
    rows = [
        "| cluster | GPUs | ring | "
        + " | ".join(f"{p} step s" for p in POLICIES)
        + " | dcp / megatron-dcp | splits dcp ran (micro-batches) |",
        "| --- | ---: | --- | " + " | ".join("---:" for _ in POLICIES) + " | ---: | --- |",
    ]
    for cl_name, make in (("H200 NVLink", h200_cluster), ("H200 PCIe", pcie)):
        for world in (64, 128):
            for ring in (False, True):
                cluster = dataclasses.replace(make(world), ring=ring)
                w = Workload(model, tuple(long_mix()))
                _, steps, runs, _ = run_policies(
                    w, AnalyticCost(model, cluster), cluster, POLICIES, tokens_per_step=TOKENS_PER_STEP
                )
                per = {k: r.sim.total_time / len(steps) for k, r in runs.items()}
                splits: dict[str, int] = {}
                for p in runs["dcp"].plans:
                    for mb in p.micro_batches():
                        if mb.layout.ring > 1:
                            splits[mb.layout.sp_words()] = splits.get(mb.layout.sp_words(), 0) + 1
                words = ", ".join(f"{k} ({n})" for k, n in sorted(splits.items(), key=lambda kv: -kv[1])) or "-"
                rows.append(
                    f"| {cl_name} | {world} | {'on' if ring else 'off'} | "
                    + " | ".join(f"{per[p]:.3f}" for p in POLICIES)
                    + f" | {per['megatron-dcp'] / per['dcp']:.3f}x | {words} |"
                )
    return rows


def main() -> int:
    t0 = time.perf_counter()
    single = single_cases()
    mix = mix_table()
    print(
        f"<!-- {time.strftime('%Y-%m-%d')}: {sys.argv[0]} in {time.perf_counter() - t0:.0f} s; python "
        f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"{platform.machine()} -->"
    )
    print("\n".join(single))
    print()
    print("\n".join(mix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
