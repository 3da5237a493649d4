"""`plan/assemble.py`: the one `StepPlan` assembly (idle ranks per phase), the LPT and
round-robin dealers; and that no planner builds a `StepPlan` another way."""

import ast
from pathlib import Path

from dcparallel.plan.assemble import idle_ranks, lpt, round_robin, with_idle
from dcparallel.plan.types import GroupPlan, MicroBatch
from dcparallel.spec import Layout

PLAN = Path(__file__).resolve().parents[2] / "dcparallel" / "plan"


def _mb(i: int, sp: int) -> tuple[MicroBatch, ...]:
    return (MicroBatch((i,), Layout(sp, 1)),)


def test_with_idle_adds_one_rank_groups_per_phase_after_the_given_ones():
    wide = GroupPlan((4, 5, 6, 7), _mb(0, 4), 1)
    narrow = [GroupPlan((2, 3), _mb(1, 2), 0), GroupPlan((6, 7), _mb(2, 2), 0)]
    got = with_idle([wide, *narrow], 8)
    assert [(g.phase, g.ranks) for g in got] == [
        (0, (2, 3)),
        (0, (6, 7)),
        (0, (0,)),
        (0, (1,)),
        (0, (4,)),
        (0, (5,)),  # as given, then idle ascending
        (1, (4, 5, 6, 7)),
        (1, (0,)),
        (1, (1,)),
        (1, (2,)),
        (1, (3,)),
    ]
    assert all(not g.micro_batches for g in got if len(g.ranks) == 1)
    by_rank = with_idle([wide, *narrow], 8, by_rank=True)
    assert [(g.phase, g.ranks[0]) for g in by_rank] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 4),
        (0, 5),
        (0, 6),
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
    ]
    assert sorted(by_rank, key=lambda g: (g.phase, g.ranks)) == sorted(got, key=lambda g: (g.phase, g.ranks))


def test_idle_ranks_with_and_without_gaps():
    assert idle_ranks(8, [(0, 1, 2, 3), (4, 5)]) == [6, 7]
    assert idle_ranks(8, [(4, 5, 6, 7), (0, 1)]) == [2, 3]
    assert idle_ranks(4, []) == [0, 1, 2, 3]


def test_lpt_deals_longest_first_to_the_least_loaded_bin():
    bins, loads = lpt([3.0, 5.0, 1.0, 5.0, 2.0], 2)
    # order dealt: 5.0 (item 1) -> bin 0, 5.0 (item 3) -> bin 1 (ties: the earlier item, the lower bin),
    # 3.0 -> bin 0, 2.0 -> bin 1, 1.0 -> bin 1
    assert bins == [[0, 1], [2, 3, 4]] and loads == [8.0, 8.0]
    dealt, _ = lpt([3.0, 5.0, 1.0, 5.0, 2.0], 2, dealt_order=True)
    assert dealt == [[1, 0], [3, 4, 2]]
    assert round_robin(5, 2) == [[0, 2, 4], [1, 3]]


def test_no_planner_builds_a_step_plan_but_assemble():
    """Every `StepPlan(...)` call under `plan/` is in `assemble.py` (idle ranks and tokens one way)."""
    calls = []
    for p in sorted(PLAN.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "StepPlan":
                calls.append(f"{p.relative_to(PLAN)}:{node.lineno}")
    assert calls and all(c.startswith("assemble.py:") for c in calls), calls
