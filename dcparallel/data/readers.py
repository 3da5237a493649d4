"""Rows of a dataset file, each with where it came from, and the bad-data report.

`read_rows` reads JSONL (one JSON object a line), CSV (a header line, then one row a line),
Parquet (pyarrow) or a Hugging Face `datasets` directory written by ``save_to_disk``; every
row carries ``where`` (``file:line`` for text files, ``file row i`` for columnar ones), so a
problem found later names its place. `BadData` gathers the problems of a whole pass and
either raises them together (the default: before training starts) or skips those samples
and reports them (``skip_bad``). pyarrow and datasets are optional: imported only for
their formats.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: how many problems an error message lists (the count covers them all)
SHOWN = 10


@dataclass(frozen=True)
class Row:
    """One record of a dataset file and where it is (``file:line`` or ``file row i``)."""

    where: str
    value: dict[str, Any]


@dataclass
class BadData:
    """Problems found in a pass over a dataset: (where, what) pairs. `finish` raises them
    all at once, or, with ``skip_bad``, logs them and leaves the caller to drop those rows."""

    source: str
    skip_bad: bool = False
    problems: list[tuple[str, str]] = field(default_factory=list)

    def add(self, where: str, what: str) -> None:
        self.problems.append((where, what))

    def finish(self, total: int) -> None:
        if not self.problems:
            return
        lines = "\n".join(f"  {w}: {m}" for w, m in self.problems[:SHOWN])
        more = f"\n  ... and {len(self.problems) - SHOWN} more" if len(self.problems) > SHOWN else ""
        if not self.skip_bad:
            raise ValueError(
                f"{self.source}: {len(self.problems)} bad sample(s) of {total}:\n{lines}{more}\n"
                f"fix or remove them, or skip them with skip_bad = true"
            )
        log.warning(
            "%s: skipped %d bad sample(s) of %d (skip_bad):\n%s%s", self.source, len(self.problems), total, lines, more
        )


def is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_info.json").exists() or (path / "state.json").exists() or (path / "dataset_dict.json").exists()
    )


def read_rows(path: str | Path) -> list[Row]:
    """Every record of ``path`` (.jsonl / .json lines, .csv, .parquet, or a save_to_disk
    directory), in file order. A line that is not a JSON object is an error naming its line."""
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"the dataset {p} does not exist; give a .jsonl, .csv, .parquet file or a datasets save_to_disk directory"
        )
    if p.is_dir():
        return _read_hf(p)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(p)
    if suffix == ".csv":
        with open(p, newline="") as f:
            return [Row(f"{p}:{i + 2}", dict(r)) for i, r in enumerate(csv.DictReader(f))]
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ValueError(f"reading {p} needs pyarrow: pip install 'dcparallel[train]' (or pyarrow)") from exc
        return [Row(f"{p} row {i}", r) for i, r in enumerate(pq.read_table(p).to_pylist())]
    raise ValueError(
        f"{p}: unknown dataset format {suffix!r}; give .jsonl, .csv, .parquet or a datasets save_to_disk directory"
    )


def _read_jsonl(p: Path) -> list[Row]:
    rows = []
    with open(p) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{i}: not a JSON object ({exc.msg}); write one JSON object a line") from None
            if not isinstance(value, dict):
                raise ValueError(f"{p}:{i}: a JSON {type(value).__name__}, not an object; write one JSON object a line")
            rows.append(Row(f"{p}:{i}", value))
    return rows


def _read_hf(p: Path) -> list[Row]:
    if not is_hf_dataset_dir(p):
        raise ValueError(
            f"{p} is a directory but not a datasets save_to_disk directory (no dataset_info.json / "
            f"state.json); give a .jsonl, .csv or .parquet file or such a directory"
        )
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(f"reading {p} needs datasets: pip install 'dcparallel[train]' (or datasets)") from exc
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"{p} holds the splits {sorted(ds)}; give one split's directory, e.g. {p / next(iter(ds))}")
    return [Row(f"{p} row {i}", dict(r)) for i, r in enumerate(ds)]


def content_hash(path: str | Path) -> str:
    """sha256 of a file's bytes, or of every file under a directory (names and bytes)."""
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
    for f in files:
        if p.is_dir():
            h.update(str(f.relative_to(p)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
