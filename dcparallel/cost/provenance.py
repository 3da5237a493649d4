"""What a cost model's GPU numbers rest on (`calibration_source`): which measurements, of
which GPU, from when — or that a number is analytic, with no measurement behind it.

`AnalyticCost` fits its compute and memory constants to the packaged calibration files
(`dcparallel/calibration/`, measured on one GPU elsewhere; their README): the files of its
reference block, the GPU and torch their device row names, and the date the rows record
(none do today, which is said). Its link speeds are never measured: datasheet figures,
derated (`spec.h200_cluster`). `ProfiledCost` rests on the profile it was given: the device
and torch of its fingerprint and the date the file was written.
"""

from __future__ import annotations

import datetime
import json
from importlib import resources
from pathlib import Path
from typing import Any

from dcparallel.cost.profiled import ProfiledCost

#: the calibration files `cost.calibration_fit.fit_calibration` reads for each reference block
CALIBRATION_FILES = {
    "llama-7b": ("h200_blocks.jsonl", "h200_blocks_2.jsonl"),
    "stdit-1.1b": ("h200_stdit_buckets.jsonl", "h200_stdit_selective.jsonl"),
}
LINKS = "analytic, no measurement (datasheet link speeds, derated: spec.h200_cluster)"
NOT_DATED = "not recorded in the calibration files"


def _rows(name: str) -> list[dict]:
    text = resources.files("dcparallel.calibration").joinpath(name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _device(files: tuple[str, ...]) -> tuple[dict | None, bool]:
    """The first device row of ``files``, else of the whole calibration set (its README: one
    GPU measured every file); whether it came from the set rather than the files."""
    for names, from_set in ((files, False), (tuple(n for v in CALIBRATION_FILES.values() for n in v), True)):
        for name in names:
            row = next((r for r in _rows(name) if r.get("kind") == "device"), None)
            if row is not None:
                return row, from_set
    return None, True


def _analytic(cost: Any) -> dict:
    name = getattr(cost, "calibration_name", None)
    if name is None:
        return {
            "cost": "analytic",
            "calibration": "given by the caller (not a packaged file)",
            "files": [],
            "gpu": "unknown",
            "torch": "unknown",
            "date": "unknown",
            "links": LINKS,
        }
    files = CALIBRATION_FILES[name]
    row, from_set = _device(files)
    gpu = row.get("name", "unknown") if row else "unknown"
    return {
        "cost": "analytic",
        "calibration": name,
        "files": [f"dcparallel/calibration/{f}" for f in files],
        "gpu": gpu + (" (the calibration set's device row)" if row and from_set else ""),
        "torch": row.get("torch", "unknown") if row else "unknown",
        "date": (row or {}).get("date", NOT_DATED),
        "links": LINKS,
    }


def _profiled(cost: Any, profile_path: Path | None) -> dict:
    fp = cost.profile.fingerprint
    date = "unknown (the profile was not read from a file)"
    if profile_path is not None and Path(profile_path).exists():
        mtime = Path(profile_path).stat().st_mtime
        date = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).strftime("%Y-%m-%d (file written)")
    links = (
        "measured in the profile"
        if cost.cluster.shard_size == cost.profile.shard_size
        else f"shard blocks priced from an unsharded profile: {LINKS}"
    )
    return {
        "cost": "profiled",
        "calibration": "the profile",
        "files": [str(profile_path)] if profile_path else [],
        "gpu": str(fp.get("device", "unknown")),
        "torch": str(fp.get("torch", "unknown")),
        "date": date,
        "links": links,
    }


def calibration_source(cost: Any, profile_path: Path | None = None) -> dict:
    """Where ``cost``'s GPU numbers come from: ``cost`` ("analytic" / "profiled"),
    ``calibration``, ``files``, ``gpu``, ``torch``, ``date`` and ``links`` (the
    communication's basis). ``profile_path``: the file a `ProfiledCost`'s profile was read from."""
    if isinstance(cost, ProfiledCost):
        return _profiled(cost, profile_path)
    return _analytic(cost)


def describe(src: dict) -> str:
    """One line for the printed table."""
    files = f" ({', '.join(src['files'])})" if src["files"] else ""
    return (
        f"GPU numbers: {src['cost']} cost, calibration {src['calibration']}{files}, measured on {src['gpu']} "
        f"(torch {src['torch']}), date {src['date']}; links: {src['links']}"
    )
