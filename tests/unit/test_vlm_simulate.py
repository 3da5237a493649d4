"""`simulate --model qwen2.5-vl-7b` and its lengths files with image sizes: the preset's
parameters are transformers' Qwen2.5-VL-7B's, the file's images grid as the real image
processor grids them, and a bad line or a model without a vision tower is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcparallel.data.vision_sizes import read_vision_lengths, tower_processor
from dcparallel.scenarios import MODEL_PRESETS
from dcparallel.spec import VisionSize

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
VLM = MODEL_PRESETS["qwen2.5-vl-7b"]


def test_the_preset_has_qwen2_5_vl_7b_parameters():
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = transformers.Qwen2_5_VLVisionConfig(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    )
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg)
    assert VLM.vision.num_params == sum(p.numel() for p in tower.parameters()) == 676_550_144
    assert VLM.vision.layer_params == sum(p.numel() for p in tower.blocks[0].parameters())
    assert VLM.vision.full_layers == len(cfg.fullatt_block_indexes) and VLM.vision.num_layers == cfg.depth
    assert VLM.vision.window == (cfg.window_size // cfg.patch_size) ** 2
    assert VLM.num_params == 8_292_166_656  # language model + tower, as transformers builds the whole model


def _write(tmp_path, lines) -> str:
    p = tmp_path / "lengths.jsonl"
    p.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return p


def test_a_lengths_file_grids_images_as_the_processor_does(tmp_path):
    # Qwen2.5-VL-7B's image processor as its preprocessor_config.json sets it
    proc = transformers.Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)
    Image.fromarray(np.zeros((40, 60, 3), dtype=np.uint8)).save(tmp_path / "small.png")
    p = _write(
        tmp_path,
        [
            {"text": 30, "vision": [{"width": 224, "height": 224}]},
            {"text": 500, "vision": [{"width": 1344, "height": 1008}, {"image": "small.png"}]},
            {"text": 12, "vision": [{"grid": [30, 26, 46]}]},
            "",
            {"text": 70},
        ],
    )
    got = read_vision_lengths(p, VLM.vision)
    grids = [
        proc(images=[Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8))], return_tensors="pt")["image_grid_thw"][
            0
        ].tolist()
        for w, h in ((224, 224), (1344, 1008), (60, 40))
    ]
    patches = [int(np.prod(g)) for g in grids]
    assert patches[:2] == [256, 96 * 72]
    assert got == [
        VisionSize(30 + 64, (256,)),
        VisionSize(500 + patches[1] // 4 + patches[2] // 4, tuple(patches[1:])),
        VisionSize(12 + 30 * 26 * 46 // 4, (30 * 26 * 46,)),
        70,
    ]
    assert type(got[3]) is int
    assert vars(tower_processor(VLM.vision))["size"] == proc.size and proc.merge_size == VLM.vision.merge


@pytest.mark.parametrize(
    "line,match",
    [
        ({"vision": []}, "'text'"),
        ({"text": -1}, "token count"),
        ({"text": 5, "vision": [{"w": 1}]}, "has no size"),
        ("{oops", "Expecting"),
    ],
)
def test_a_bad_line_is_refused_with_its_number(tmp_path, line, match):
    p = _write(tmp_path, [{"text": 3}, line])
    with pytest.raises(ValueError, match=f"lengths.jsonl:2: .*{match}"):
        read_vision_lengths(p, VLM.vision)


def test_simulate_plans_the_vlm_preset_from_a_lengths_file(tmp_path, capsys):
    from dcparallel.apps.cli import main

    rng = np.random.default_rng(0)
    p = _write(
        tmp_path,
        [
            {
                "text": int(rng.integers(10, 2000)),
                "vision": [{"width": int(rng.integers(224, 1345)), "height": int(rng.integers(224, 1345))}]
                * int(rng.integers(0, 3)),
            }
            for _ in range(200)
        ],
    )
    assert (
        main(
            [
                "simulate",
                "--model",
                "qwen2.5-vl-7b",
                "--lengths",
                str(p),
                "--world",
                "8",
                "--max-steps",
                "1",
                "--tokens-per-step",
                str(2**17),
                "--policy",
                "dcp",
                "--policy",
                "bucket",
                "--policy",
                "packed",
                "--json",
                "--quiet",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == "qwen2.5-vl-7b" and out["num_params"] == VLM.num_params
    for v in out["policies"].values():
        assert v["samples_dropped"] == 0 and v["memory_violations"] == 0 and v["epoch_time_s"] > 0
    with pytest.raises(SystemExit, match=r"vision-language samples; give a vision-language --model \(qwen2.5-vl-7b"):
        main(["simulate", "--model", "llama-8b", "--lengths", str(p), "--world", "8", "--json"])


def test_model_config_of_a_vlm_folder_prices_its_own_tower(tmp_path, capsys):
    """`--model-config` on a Qwen2.5-VL-7B folder (its config.json and preprocessor_config.json,
    no weights) reads the vision_config: the same tower and parameters as the preset, and
    simulate prices it from a lengths file with image sizes."""
    from dcparallel.apps.cli import main
    from dcparallel.apps.model_config import _pixel_bounds, spec_from_config

    folder = tmp_path / "qwen2.5-vl-7b"
    text = dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    )
    transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    ).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "patch_size": 14,
                "merge_size": 2,
                "size": {"shortest_edge": 3136, "longest_edge": 12845056},
            }
        )
    )
    spec = spec_from_config(folder)
    assert spec.vision == VLM.vision and spec.num_params == VLM.num_params
    assert spec.extra_params == VLM.extra_params  # the tower's parameters counted once, in the tower
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 64 * 28 * 28, "longest_edge": 256 * 28 * 28}})
    )
    assert _pixel_bounds(folder) == {"min_pixels": 64 * 28 * 28, "max_pixels": 256 * 28 * 28}

    p = _write(tmp_path, [{"text": 300, "vision": [{"width": 1344, "height": 1344}]}, {"text": 2000}] * 40)
    assert (
        main(
            [
                "simulate",
                "--model-config",
                str(folder),
                "--lengths",
                str(p),
                "--world",
                "8",
                "--max-steps",
                "1",
                "--tokens-per-step",
                str(2**16),
                "--policy",
                "dcp",
                "--json",
                "--quiet",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == "qwen2.5-vl-7b" and out["num_params"] == VLM.num_params
    assert out["policies"]["dcp"]["samples_dropped"] == 0 and out["policies"]["dcp"]["epoch_time_s"] > 0
