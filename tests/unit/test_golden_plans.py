"""`dcp` plans the golden cells exactly as when `tests/golden/plan_hashes.json` was written
(`benchmarks/tools/plan_hashes.py --golden`): a dozen scale-report cells, 2 steps each, every
plan's groups, phases, micro-batches' sample ids and layouts hashed. A change to the planner
meant to keep its plans (a refactor, a speed-up) must pass this unchanged; one meant to alter
plans writes the file again and says so in its commit."""

from __future__ import annotations

import json

import pytest

from benchmarks.tools.plan_hashes import GOLDEN_CELLS, GOLDEN_PATH, Cell, cell_plans, plan_hash

GOLDEN = json.loads(GOLDEN_PATH.read_text())


def test_golden_file_holds_the_golden_cells():
    assert GOLDEN["policy"] == "dcp" and GOLDEN["steps"] == 2
    assert sorted(GOLDEN["cells"]) == sorted(c.key for c in GOLDEN_CELLS)


@pytest.mark.parametrize("key", sorted(GOLDEN["cells"]))
def test_plans_match_golden_hashes(key):
    want = GOLDEN["cells"][key]
    cell = Cell(want["budget"], want["world"], want["scenario"], want["distribution"], want["ring"])
    assert cell.key == key
    _, plans, _ = cell_plans(cell, GOLDEN["policy"], GOLDEN["steps"])
    got = [plan_hash(p) for p in plans]
    changed = [i for i, (a, b) in enumerate(zip(want["steps"], got)) if a != b]
    assert len(got) == len(want["steps"]) and not changed, (
        f"cell {key!r}: the plans of steps {changed} differ from tests/golden/plan_hashes.json"
    )
