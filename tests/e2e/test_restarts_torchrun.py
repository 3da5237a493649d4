"""Process faults under `torchrun --max-restarts`: a rank that exits, raises or hangs mid-step
(DCPARALLEL_FAULT, tests/faults.py) is restarted from the last committed checkpoint, and the finished run has
the per-step losses of an uninterrupted run, bit for bit, with every sample of the epoch
trained exactly once (2 gloo ranks, analytic cost: no profiling). The uninterrupted run
trains first in the same launch (``--reference``: fresh processes, no faults), so one launch
starts the ranks four times, not five."""

import json

import pytest

from tests.faults import launch, run_config

pytestmark = pytest.mark.e2e


def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


#: the step watchdog's seconds: the hang's wait. A step of this run takes a few hundredths of a
#: second of processor time (its tiny model's micro-batches and update; planning, checkpoints
#: and restarts fall outside the watched step), so 3 s is still a wide margin on a loaded machine
WATCHDOG_S = 3


def test_exit_raise_and_hang_restart_and_lose_nothing(tmp_path):
    ref_config, ref = run_config(tmp_path, "ref", step_timeout_s=WATCHDOG_S)
    config, out = run_config(tmp_path, "faults", step_timeout_s=WATCHDOG_S)
    # attempt 0: the reference run, then rank 1 of the faulted one dies at step 3; attempt 1:
    # rank 0 raises at step 6 (step 5 replayed); attempt 2: rank 1 hangs at step 7 until the
    # step watchdog ends it; attempts 1-3 find the reference finished and skip it
    r = launch(config, cwd=tmp_path, fault="exit@3:1:0,raise@6:0:1,hang@7:1:2", restarts=3, reference=ref_config)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = _metrics(ref)
    num_steps = len(reference)
    assert num_steps >= 7
    assert [m["global_step"] for m in reference] == list(range(1, num_steps + 1))  # trained once, whole
    assert "injected fault: raise at step 6 on rank 0" in r.stderr and f"Timeout (0:00:0{WATCHDOG_S})!" in r.stderr
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"]) for e in events if e["event"] == "fault"] == [("exit", 3), ("raise", 6), ("hang", 7)]
    resumes = [(e["attempt"], e["step"], e["replayed"]) for e in events if e["event"] == "resume"]
    assert resumes == [(1, 2, 0), (2, 4, 1), (3, 6, 0)]
    got = _metrics(out)
    assert [m["global_step"] for m in got] == list(range(1, num_steps + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in reference]  # bit-identical
    ids = [i for m in got for i in m["sample_ids"]]
    assert sorted(ids) == list(range(36))  # every sample exactly once
