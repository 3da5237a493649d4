"""A profile saved as it goes, and the wall-time budget that makes it coarser when it runs long.

`Journal`: every rank appends each layout chain it finished — (bucket, SP degree, recompute
mode): the micro-batch sizes measured for it — to its own file beside the profile
(``profile.json.partial.rank0.json``; an atomic rewrite after every chain). A profile killed
part-way and started again with the same model, launch, buckets and settings (``key``)
skips every chain that all of its group's ranks finished, and the rank that speaks for the
group (its first) brings those entries back from its file. The files are removed once the
whole profile is saved.

`Budget`: ``ProfilerConfig.budget_s`` seconds of wall time, the same on every rank. Once it
has passed on any rank of a group, the group measures the rest coarsely: no larger micro-
batches (the cost model extrapolates them from one sample), only recompute "none" and "full"
(the planners then choose between those two), and one timed round per layout instead of
rounds until the median is stable. Each chain still measured costs a warm-up and one round,
so a profile ends past its budget by about that much per remaining chain, not at it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dcparallel.cost.schema import ProfileEntry

Chain = tuple[str, int, str]
"""(bucket key, SP degree, recompute mode)"""

#: the recompute modes a profile past its budget still measures
COARSE_MODES = ("none", "full")


class Journal:
    """This rank's record of finished chains of one profile (``key``: what it measures)."""

    def __init__(self, profile_path: str | Path, rank: int, key: str):
        p = Path(profile_path)
        self.path = p.with_name(f"{p.name}.partial.rank{rank}.json")
        self.key = key
        self.done: dict[Chain, list[dict]] = {}
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if saved.get("key") == key:
            self.done = {(b, int(sp), m): entries for b, sp, m, entries in saved["chains"]}

    def record(self, chain: Chain, entries: list[ProfileEntry]) -> None:
        """``chain`` finished: its entries (none on a rank that does not speak for its group)."""
        self.done[chain] = [e.to_json() for e in entries]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"key": self.key, "chains": [[*c, es] for c, es in self.done.items()]}))
        os.replace(tmp, self.path)

    def entries(self, chain: Chain) -> list[ProfileEntry]:
        return [ProfileEntry(**e) for e in self.done.get(chain, [])]

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class Budget:
    """Wall time left of ``seconds`` (None: no budget) from when it is made."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.start = time.perf_counter()

    def over(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.start > self.seconds
