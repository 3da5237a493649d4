"""`dcp`'s group allocation: the groups per SP degree of one class-level layout choice.

Groups are taken away while they cannot all be placed (`LayoutTable.placed`), then added to
the degree that finishes last while that shortens it and they can be placed; a degree's span
is its micro-batch classes dealt to its groups (`classes.class_span`).

Short names: p (the `tables.LayoutTable`), j (a class: a planning class's index), k (an SP
degree), mm / tt / q (a micro-batch class's size, time and count), v (a degree's micro-batch
classes), sig (their id, `LayoutTable.span_id`).
"""

from __future__ import annotations

import math

from dcparallel.plan.dcp.classes import Allocation, DegreeGroups, ItemClass, MbClass
from dcparallel.plan.dcp.search import Row
from dcparallel.plan.dcp.tables import LayoutTable
from dcparallel.plan.types import TIME_EPS


def allocate(p: LayoutTable, present: list[int], chosen: list[Row], need: dict[int, int]) -> Allocation | None:
    """The `Allocation` of one layout choice on table `p` (`chosen`: each class's row, in the
    order of `present`) and the groups per degree its search estimated it needs:
    groups are taken away while they cannot all be placed (`LayoutTable.placed`), then added
    to the degree that finishes last while that shortens it and they can be placed; None if
    one group per degree cannot be placed."""
    items: list[ItemClass] = []
    by_k: dict[int, list[MbClass]] = {}
    for j, row in zip(present, chosen):
        k = row.k
        for mm, tt, q in ((row.m, row.t_full, row.full), (row.rem, row.t_rem, 1 if row.rem else 0)):
            if q:
                by_k.setdefault(k, []).append(MbClass(len(items), tt, q))
                items.append(ItemClass(j, k, mm, tt, q))
    count = {k: need[k] for k in by_k}
    n_items = {k: sum(q for _, _, q in v) for k, v in by_k.items()}
    while not p.placed(count):  # estimates can overshoot at the edge
        k = max((k for k in count if count[k] > 1), key=lambda k: (count[k] * k, k), default=None)
        if k is None:
            return None
        count[k] -= 1
    sig = {k: p.span_id(v) for k, v in by_k.items()}
    span = {k: p.group_span(by_k[k], count[k], sig[k]) for k in by_k}
    free = p.world - sum(k * n for k, n in count.items())
    stuck: set[int] = set()  # degrees more groups did not help
    for _ in range(64):
        order = sorted(span, key=lambda j: (-span[j], j))  # slowest first, narrower first on ties
        if order[0] in stuck:
            break  # the slowest degree cannot be helped: nothing shortens the makespan
        k = next((j for j in order if j not in stuck and j <= free and count[j] < n_items[j]), None)
        if k is None:
            break
        others = max((span[j] for j in order if j != k), default=0.0)
        # jump toward the groups that bring this degree down to the next slowest one
        want = count[k] * span[k] / max(others, span[k] * 0.5, TIME_EPS)
        step = p.room(count, k, max(1, min(free // k, n_items[k] - count[k], math.ceil(want) - count[k])))
        new = p.group_span(by_k[k], count[k] + step, sig[k]) if step else math.inf
        while step > 1 and new >= span[k] - TIME_EPS:
            step = p.room(count, k, step // 2)
            new = p.group_span(by_k[k], count[k] + step, sig[k]) if step else math.inf
        if new >= span[k] - TIME_EPS:
            if k == order[0]:
                break
            stuck.add(k)  # no help here (or no room); let another degree try
            continue
        count[k] += step
        span[k] = new
        free -= step * k
    return Allocation(max(span.values(), default=0.0), items, DegreeGroups(by_k, count))
