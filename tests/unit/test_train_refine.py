"""`dcparallel train` with ``[profile] refine_steps``: the trainer times each micro-batch of
the first steps and feeds the times to the loader (`DataCentricLoader.observe`), whose cost
model plans the later steps with the fit; the checkpoint keeps the rows, so a resumed run
plans with the same fit. One rank, in this process, the analytic cost model."""

from __future__ import annotations

import logging

from dcparallel import checkpoint
from dcparallel.apps.train_config import Config
from tests.faults import run


def _cfg(tmp_path, refine_steps: int) -> Config:
    return Config.from_dict(
        {
            "model": {"num_layers": 2, "hidden": 32, "num_heads": 2, "ffn_hidden": 64},
            "data": {"num_samples": 40},
            "train": {"tokens_per_step": 1500, "out_dir": str(tmp_path / "run"), "max_steps": 4},
            "profile": {"cost": "analytic", "refine_steps": refine_steps},
        }
    )


def test_the_first_steps_times_refine_the_cost_model(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dcparallel.data.refine"):
        assert run(_cfg(tmp_path, 2)) == 0
    said = [r.getMessage() for r in caplog.records if "refined" in r.getMessage()]
    assert len(said) == 1 and "SP 1: " in said[0], said
    state = checkpoint.latest(tmp_path / "run" / "checkpoint").meta["loader"]["refine"]
    assert state["left"] == 0 and len(state["rows"]) >= 2  # two steps' micro-batches, one rank
    assert all(r[1] == 1 and r[4] > 0 for r in state["rows"])


def test_refine_steps_0_feeds_nothing(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dcparallel.data.refine"):
        assert run(_cfg(tmp_path, 0)) == 0
    assert not [r for r in caplog.records if "refined" in r.getMessage()]
    assert checkpoint.latest(tmp_path / "run" / "checkpoint").meta["loader"]["refine"] == {"left": 0, "rows": []}
