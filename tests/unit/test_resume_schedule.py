"""A resumed `dcparallel train` run whose length changed ([train] max_steps): with a cosine lr
the next step's lr would jump, so it is refused naming both lrs, unless resume_anyway, which
resumes on the new schedule and says so; with a constant lr the new length is stated."""

from __future__ import annotations

import json
import logging

import pytest

from dcparallel.apps.train_config import Config
from tests.faults import run  # dcparallel train's run


def _cfg(tmp_path, **train) -> Config:
    t = {"tokens_per_step": 1500, "out_dir": str(tmp_path / "run"), "lr": 1e-3, **train}
    return Config.from_dict(
        {
            "model": {"num_layers": 2, "hidden": 32, "num_heads": 2, "ffn_hidden": 64},
            "data": {"num_samples": 40},
            "train": t,
            "profile": {"cost": "analytic"},
        }
    )


def _lrs(tmp_path) -> list[float]:
    return [json.loads(x)["lr"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_changed_max_steps_with_a_cosine_lr_is_refused_then_resumed_anyway(tmp_path, caplog):
    assert run(_cfg(tmp_path, max_steps=2, schedule="cosine")) == 0
    with pytest.raises(
        ValueError,
        match=r"the run's length changed \(epochs 1 -> 1, max_steps 2 -> 4\): it now ends "
        r"at step 4, not 2, and the cosine lr of step 3 would jump from 0 to "
        r"0\.0005\. Resume with the same epochs and max_steps",
    ):
        run(_cfg(tmp_path, max_steps=4, schedule="cosine"))
    with caplog.at_level(logging.WARNING, logger="dcparallel.train"):
        assert run(_cfg(tmp_path, max_steps=4, schedule="cosine", resume_anyway=True)) == 0
    assert "it now ends at step 4, not 2; the cosine lr of step 3: 0.0005 (was 0)" in caplog.text
    assert _lrs(tmp_path) == pytest.approx([1e-3, 5e-4, 5e-4, 1.464e-4], rel=1e-3)


def test_changed_max_steps_with_a_constant_lr_is_stated(tmp_path, caplog):
    assert run(_cfg(tmp_path, max_steps=1)) == 0
    with caplog.at_level(logging.WARNING, logger="dcparallel.train"):
        assert run(_cfg(tmp_path, max_steps=2)) == 0
    assert "it now ends at step 2, not 1; the constant lr of step 2: 0.001 (was 0.001)" in caplog.text
    assert len(_lrs(tmp_path)) == 2
