"""`dcparallel train` builds transformers and diffusers models described in the TOML
(family + architecture + [model.config]) and trains them through their adapters (world 1,
in-process; `tests/e2e/test_train_torchrun.py` covers torchrun); ``[train] ring`` reaches
the wrapper."""

from __future__ import annotations

import json

import pytest

from dcparallel.apps.train import run
from dcparallel.apps.train_config import Config
from tests.train_fixtures import WAN_CONFIG


def _train(tmp_path, model: dict, data: dict, tokens_per_step: int) -> list[dict]:
    cfg = Config.from_dict(
        {
            "model": model,
            "data": data,
            "train": {"tokens_per_step": tokens_per_step, "epochs": 2, "lr": 3e-3, "out_dir": str(tmp_path / "run")},
            "profile": {"cost": "analytic"},
        }
    )  # no profiling: the build, data, adapter loss and loop are tested
    assert run(cfg) == 0
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_train_a_transformers_qwen3_with_gqa_from_the_toml(tmp_path):
    pytest.importorskip("transformers")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [24, 40, 64, 100, 30, 50, 90, 120] * 3) + "\n")
    rows = _train(
        tmp_path,
        {
            "family": "transformers",
            "architecture": "Qwen3ForCausalLM",
            "config": {
                "vocab_size": 96,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
            },
        },
        {"lengths": str(lengths)},
        600,
    )
    assert len(rows) >= 4 and rows[-1]["loss"] < rows[0]["loss"]


def test_train_a_diffusers_wan_from_the_toml(tmp_path):
    pytest.importorskip("diffusers")
    rows = _train(
        tmp_path,
        {
            "family": "diffusers",
            "architecture": "WanTransformer3DModel",
            "config": WAN_CONFIG,
        },
        {"lengths": "builtin", "num_samples": 12, "text_tokens": 4},
        300,
    )
    assert len(rows) >= 4 and all(r["loss"] is not None for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_family_errors_name_the_fix():
    with pytest.raises(ValueError, match='needs architecture, e.g. "LlamaForCausalLM"'):
        Config.from_dict({"model": {"family": "transformers"}})
    with pytest.raises(ValueError, match=r"\[model\] family = 'jax' is not one of"):
        Config.from_dict({"model": {"family": "jax"}})
    with pytest.raises(ValueError, match=r"config = 3 must be a table"):
        Config.from_dict({"model": {"family": "diffusers", "architecture": "X", "config": 3}})


def test_train_ring_key_reaches_the_wrapper_and_its_groups(tmp_path):
    """``[train] ring = true`` trains with `DataCentricParallel(ring=True)`: the run's
    ClusterSpec and process groups carry ring (world 1 here: every group is one rank)."""
    seen = []
    cfg = Config.from_dict(
        {
            "data": {"lengths": "builtin", "num_samples": 8},
            "train": {"tokens_per_step": 256, "max_steps": 1, "ring": True, "out_dir": str(tmp_path / "run")},
            "profile": {"cost": "analytic"},
        }
    )
    assert run(cfg, before_step=lambda t, step: seen.append((t.dc.cluster_spec.ring, t.dc.groups.topology.ring))) == 0
    assert seen == [(True, True)]
