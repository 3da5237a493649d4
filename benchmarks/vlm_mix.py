"""Vision-language fine-tuning at 64 simulated H200: Qwen2.5-VL-7B (`simulate --model
qwen2.5-vl-7b`: its language model and its 676M vision tower, both priced by the analytic
model) on a mix of image sizes, `dcp` against `bucket`, `packed` and `megatron-dcp`, and `dcp`
planned blind to the vision tower (the same token counts as plain text) and priced with it.

    PYTHONPATH=. .venv/bin/python benchmarks/vlm_mix.py [--samples 6000] [--steps 8] [--out FILE.md]

The mix (seeded), written as a `--lengths` .jsonl (`data.vision_sizes.read_vision_lengths`):
  45% captions: 10-80 text tokens, one 224 x 224 thumbnail;
  20% chats: 100-1500 text tokens, 1-3 photos of 448 x 448, 640 x 480 or 1024 x 768;
  25% documents: 200-3000 text tokens, 1-4 pages of 672-1344 x 896-1344 pixels;
  10% short videos: 20-400 text tokens, 5-30 s at 2 fps of 640 x 360 frames.
Image grids by the Qwen2.5-VL image processor's rule (transformers' `smart_resize`: 14-pixel
patches, 2 x 2 merged, 3136 .. 12845056 pixels); video grids by its video processor's (the
frame resized within 128 .. 768 merged tokens' pixels, 2 frames per temporal patch).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from dcparallel.apps.simulate import simulate_json
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.data.vision_sizes import image_item, read_vision_lengths
from dcparallel.plan.context import PlanContext
from dcparallel.plan.policies import make_planner
from dcparallel.plan.steps import form_steps
from dcparallel.scenarios import MODEL_PRESETS
from dcparallel.sim.replay import simulate, step_seconds
from dcparallel.spec import Workload, h200_cluster

MODEL = "qwen2.5-vl-7b"
POLICIES = ["bucket", "packed", "megatron-dcp", "dcp"]
#: Qwen2.5-VL's video processor bounds on one frame's pixels (merged tokens x 28 x 28)
VIDEO = SimpleNamespace(
    patch_size=14, merge_size=2, size={"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
)


def draw(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.45:
            rec = {"text": int(rng.integers(10, 81)), "vision": [{"width": 224, "height": 224}]}
        elif u < 0.65:
            sizes = [(448, 448), (640, 480), (1024, 768)]
            rec = {
                "text": int(rng.integers(100, 1501)),
                "vision": [dict(zip(("width", "height"), sizes[rng.integers(3)])) for _ in range(rng.integers(1, 4))],
            }
        elif u < 0.90:
            rec = {
                "text": int(rng.integers(200, 3001)),
                "vision": [
                    {"width": int(rng.integers(672, 1345)), "height": int(rng.integers(896, 1345))}
                    for _ in range(rng.integers(1, 5))
                ],
            }
        else:
            frames = 2 * int(rng.integers(5, 31))
            _, h, w = image_item(640, 360, VIDEO).grid
            rec = {"text": int(rng.integers(20, 401)), "vision": [{"grid": [frames // 2, h, w]}]}
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tokens-per-step", type=int, default=2**20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lengths = Path(f"/tmp/vlm_mix_{args.seed}_{args.samples}.jsonl")
    lengths.write_text("".join(json.dumps(r) + "\n" for r in draw(args.samples, args.seed)))
    ns = argparse.Namespace(
        scenario=None,
        distribution=None,
        lengths=lengths,
        world=64,
        gpus_per_node=8,
        seed=args.seed,
        tokens_per_step=args.tokens_per_step,
        profile=None,
        model=MODEL,
        model_config=None,
        shard_size=1,
        max_steps=args.steps,
    )
    res = simulate_json(ns, POLICIES, progress=False)
    # dcp planned blind to the tower (plain token counts), replayed with the tower priced
    vlm = MODEL_PRESETS[MODEL]
    sizes = read_vision_lengths(lengths, vlm.vision)
    cl = h200_cluster(64, 8)
    seeing = PlanContext(Workload(vlm, tuple(sizes)), AnalyticCost(vlm, cl), cl)
    blind_model = __import__("dataclasses").replace(vlm, vision=None)
    blind = PlanContext(Workload(blind_model, tuple(int(s) for s in sizes)), AnalyticCost(blind_model, cl), cl)
    steps = form_steps(seeing.tokens, seed=args.seed, tokens_per_step=args.tokens_per_step)[: args.steps]
    planner = make_planner("dcp", blind, steps, score=step_seconds(blind))
    blind = simulate([planner.plan(s) for s in steps], seeing)
    blind_s = blind.total_time
    patches = [sum(s.patches) for s in sizes if hasattr(s, "patches")]
    res["vision"] = {
        "samples_with_images": len(patches),
        "patches_total": int(sum(patches)),
        "tokens_total": int(sum(int(s) for s in sizes)),
        "dcp_vision_blind_epoch_s": round(blind_s, 4),
        "dcp_vision_blind_memory_violations": blind.memory_violations,
    }
    rows = [
        f"| {k} | {v['epoch_time_s']:.2f} | {res['speedup_vs_bucket'][k]:.2f} | {v['idle_fraction']:.3f} | "
        f"{v['lower_bound_efficiency']:.3f} | {v['memory_violations']} | {v['plan_ms_per_step']:.0f} | "
        f"{json.dumps({a: b for a, b in v['settings'].items() if a != 'tried_s'})} |"
        for k, v in res["policies"].items()
    ]
    dcp_s = res["policies"]["dcp"]["epoch_time_s"]
    rows.append(
        f"| dcp, planned blind to the tower | {blind_s:.2f} | "
        f"{res['policies']['bucket']['epoch_time_s'] / blind_s:.2f} | | {res['lower_bound_s'] / blind_s:.3f} "
        f"| {blind.memory_violations} | | priced with the tower |"
    )
    head = (
        f"# vlm mix at 64 simulated H200 ({dt.date.today()})\n\n`PYTHONPATH=. python benchmarks/vlm_mix.py "
        f"{' '.join(sys.argv[1:])}`; Python {platform.python_version()}, {platform.machine()}\n\n"
        f"{res['samples_total']} samples, {res['steps']} steps of {res['tokens_per_step']:,} tokens; "
        f"{len(patches)} with images or videos, {sum(patches):,} vision patches, "
        f"{res['vision']['tokens_total']:,} language-model tokens; lower bound {res['lower_bound_s']:.2f} s; "
        f"blind dcp / dcp = {blind_s / dcp_s:.3f}\n\n"
        "| policy | epoch s | speedup vs bucket | idle | bound eff. | memory violations | plan ms/step | settings |"
        "\n|---|---|---|---|---|---|---|---|\n"
    )
    text = head + "\n".join(rows) + "\n"
    print(text)
    print(json.dumps(res))
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
