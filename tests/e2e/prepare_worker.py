"""A transformers Llama (GQA) and a diffusers Wan transformer, each through the public API
with no profiling code of its own: `prepare` profiles it at this world size through its
adapter's loss, then a few steps train on the plan. `run` returns one record per model; as a
torchrun worker (tests/e2e/test_prepare_torchrun.py) rank 0 prints them as JSON lines.
tests/unit/test_adapters.py calls `run` in-process at world 1."""

import json
import sys

import torch

import dcparallel
from dcparallel.data.synthetic import SyntheticLatents, SyntheticText
from dcparallel.profile.profiler import ProfilerConfig
from dcparallel.runtime.launch import init_distributed
from tests.adapter_models import build
from tests.support import train_steps

CONFIG = ProfilerConfig.quick(256, repeats=1, max_repeats=1, min_time_s=0.0, max_mbs=4)


def train(out_dir, name, model, dataset, lengths, epochs, **budget):
    dc = dcparallel.DataCentricParallel(model, memory_bytes=2**30)
    loader = dc.prepare(
        dataset, lengths=lengths, profile_path=f"{out_dir}/{name}.json", profiler_config=CONFIG, **budget
    )
    opt = dc.optimizer(lr=3e-3)
    losses, sp = [], set()
    for epoch in range(epochs):
        dc.set_epoch(epoch)
        for step, loss in train_steps(dc, model, loader, opt):
            losses.append(loss)
            sp |= set(step.plan.busy_sizes())
    return {
        "model": name,
        "losses": losses,
        "sp": sorted(sp),
        "world": dc.world_size,
        "profiled": len(dc.profile.entries),
        "rank": dc.rank,
    }


def run(out_dir) -> list[dict]:
    lengths = [24, 40, 64, 100, 180, 30, 50, 90, 200, 120] * 4
    shapes = [(1, 4, 4), (2, 4, 6), (2, 6, 4), (3, 4, 4)] * 4
    return [
        train(
            out_dir, "hf-llama", build("hf-llama"), SyntheticText(lengths, vocab=96), lengths, 2, tokens_per_step=1200
        ),
        train(
            out_dir,
            "wan",
            build("wan"),
            SyntheticLatents(shapes, channels=4, text_dim=16, text_tokens=5),
            shapes,
            3,
            samples_per_step=8,
        ),
    ]


if __name__ == "__main__":
    torch.set_num_threads(1)
    init_distributed()
    for record in run(sys.argv[1]):
        if record["rank"] == 0:
            print(json.dumps(record), flush=True)
