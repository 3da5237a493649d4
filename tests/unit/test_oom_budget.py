"""An out-of-memory exit lowers the memory budget of the restarted run instead of replaying
the plan that failed: `abort_on_oom` records the failed attempt next to the run's
checkpoints, and the trainer plans the restart with `OOM_BUDGET_FACTOR` per recorded exit."""

from __future__ import annotations

import logging

import pytest

from dcparallel.apps.train_config import Config
from dcparallel.apps.trainer import Trainer
from dcparallel.runtime import comm, launch
from dcparallel.spec import Layout


def _abort(monkeypatch):
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm, "world_rank", lambda: 1)

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(launch.os, "_exit", exit_)
    with pytest.raises(SystemExit) as stop:
        launch.abort_on_oom(
            MemoryError("injected"), step=3, epoch=0, layout=Layout(2, 1), ranks=(0, 1), sample_ids=(7,), seq_len=40
        )
    assert stop.value.code == launch.OOM_EXIT_CODE


def test_each_failed_attempt_is_recorded_once(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_oom_dir", [])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    launch.record_ooms_in(tmp_path)
    _abort(monkeypatch)
    _abort(monkeypatch)  # a second rank of the same attempt
    assert launch.oom_restarts(tmp_path) == 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _abort(monkeypatch)
    assert launch.oom_restarts(tmp_path) == 2
    assert launch.oom_budget(1000, 2) == 810


def _budget(tmp_path) -> int:
    cfg = Config.from_dict({"train": {"out_dir": str(tmp_path), "memory_mib": 1000}})
    trainer = Trainer(cfg, synthetic_sizes=[])
    return trainer._memory_budget()


def test_the_restart_plans_with_the_lowered_budget_and_says_so(tmp_path, caplog):
    assert _budget(tmp_path) == 1000 * 2**20
    for attempt in range(2):
        (tmp_path / f"oom-r1-attempt{attempt}").touch()
    with caplog.at_level(logging.WARNING, logger="dcparallel.train"):
        assert _budget(tmp_path) == int(1000 * 2**20 * 0.9**2)
    assert "2 earlier attempt(s) ran out of memory" in caplog.text
    assert "planning with a memory budget of 810 MiB, 0.81 x 1000 MiB" in caplog.text
