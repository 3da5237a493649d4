"""Fault injection for `dcparallel train` (tests, the reliability report) and the events log.

``DCPARALLEL_FAULT="KIND@STEP:RANK[:ATTEMPT],..."`` makes rank RANK, during global step STEP
(1-based), of restart ATTEMPT (torchrun's ``TORCHELASTIC_RESTART_COUNT``, default 0) ``exit``
(os._exit(17)), ``raise`` (RuntimeError), ``hang`` (sleep until the watchdog or the
process-group timeout ends it) or ``nan`` (its loss becomes NaN).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dcparallel.train")

FAULT_ENV = "DCPARALLEL_FAULT"
FAULT_KINDS = ("exit", "raise", "hang", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    attempt: int = 0


def parse_faults(spec: str) -> list[Fault]:
    """``"exit@3:1,hang@5:0:1"`` -> faults; ValueError naming the bad item and the format."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            kind, rest = item.split("@")
            nums = [int(x) for x in rest.split(":")]
            if kind not in FAULT_KINDS or len(nums) not in (2, 3) or min(nums) < 0 or nums[0] < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: bad item {item!r}; write KIND@STEP:RANK[:ATTEMPT] with KIND one of "
                             f"{', '.join(FAULT_KINDS)}, STEP >= 1 (global, 1-based), e.g. exit@3:1") from None
        out.append(Fault(kind, *nums))
    return out


def fire(fault: Fault, events: Path | None) -> bool:
    """Carries out a fault; True for "nan" (the caller poisons the loss)."""
    append_event(events, {"event": "fault", "kind": fault.kind, "step": fault.step, "rank": fault.rank,
                          "attempt": fault.attempt})
    log.error("injected fault: %s at step %d on rank %d (attempt %d)", fault.kind, fault.step, fault.rank,
              fault.attempt)
    if fault.kind == "exit":
        sys.stderr.flush()
        os._exit(17)
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault: raise at step {fault.step} on rank {fault.rank}")
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    return True


def append_event(path: Path | None, record: dict) -> None:
    """Appends one event line (rank 0 writes them; a faulting rank writes its fault)."""
    if path is None:
        return
    with open(path, "a") as f:
        f.write(json.dumps({**record, "time": time.time()}) + "\n")

