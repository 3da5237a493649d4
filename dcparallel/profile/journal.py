"""A profile saved as it goes, and the wall-time budget that makes it coarser when it runs long.

`Journal`: every rank appends each layout chain it finished — (bucket, SP degree, recompute
mode): the micro-batch sizes measured for it — to its own file beside the profile
(``profile.json.partial.rank0.json``; an atomic rewrite after every chain). A profile killed
part-way and started again with the same model, launch, buckets and settings (``key``)
skips every chain that all of its group's ranks finished, and the rank that speaks for the
group (its first) brings those entries back from its file. The files are removed once the
whole profile is saved.

The budget that decides how much of a profile is measured is `profile.budget`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dcparallel.cost.schema import ProfileEntry
from dcparallel.profile.budget import Chain


class Journal:
    """This rank's record of finished chains of one profile (``key``: what it measures)."""

    def __init__(self, profile_path: str | Path, rank: int, key: str):
        p = Path(profile_path)
        self.path = p.with_name(f"{p.name}.partial.rank{rank}.json")
        self.path.parent.mkdir(parents=True, exist_ok=True)  # the profile's folder (`Profile.save` makes it too)
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
