"""`dcp`'s expansion of a chosen class-level plan to sample ids and plan objects.

Micro-batches are dealt to groups, refined with each micro-batch's own time, moved across SP
degrees, and placed on ranks.

Each bucket's samples, longest first, are cut into its micro-batches and dealt round by round
to the groups holding that bucket (so every group gets a mix of its bucket's longer and
shorter samples); groups are placed as aligned blocks, largest first (a group no larger than
a node stays inside one; a larger one spans nodes and the cost model charges the link).
Plan objects (`MicroBatch`, `GroupPlan`) are built only for the expansion that is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dcparallel.plan.dcp_classes import GroupClass, deal_classes
from dcparallel.plan.steps import Step
from dcparallel.plan.types import BALANCED, MIN_GAIN, GroupPlan, MicroBatch, StepPlan

if TYPE_CHECKING:
    from dcparallel.plan.dcp_scale import ScalePlanner


Phases = list[tuple[list[int], list[list[tuple]]]]


def expand(p: ScalePlanner, parts, members: dict[int, list[int]], cumw: dict[int, np.ndarray]
           ) -> tuple[Phases, float]:
    """The groups (SP degrees, widest first) and their micro-batches of each phase of a
    class-level plan, and the predicted step time (each micro-batch timed by its samples'
    weights; `cumw`: per bucket the running sum of its members' weights, from 0). A
    micro-batch is (range of its bucket's members, layout, time, bucket, mean weight): the
    sample ids are taken only for the expansion kept (`build_plan`)."""
    cursor = {j: 0 for j in members}
    predicted = 0.0
    phases: Phases = []
    for _, items, (by_k, count), _ in parts:
        gclasses = {k: deal_classes(by_k[k], count[k]) for k in by_k}
        # every group of the phase, widest first; a group class is a range of them
        ranges: list[tuple[int, int, GroupClass]] = []  # (first group, degree, class)
        sizes: list[int] = []
        for k in sorted(gclasses, reverse=True):
            for gc in sorted(gclasses[k], key=lambda c: (-c.load, sorted(c.items.items()))):
                ranges.append((len(sizes), k, gc))
                sizes.extend([k] * gc.count)
        chunks: list[list[tuple]] = [[] for _ in sizes]  # (members range, layout, time, bucket, mean weight)
        held: dict[int, list[tuple[int, int, int]]] = {}  # item class -> its groups (first, count, per group)
        for g0, _, gc in ranges:
            for ic, q in gc.items.items():
                if q:
                    held.setdefault(ic, []).append((g0, gc.count, q))
        for ic, it in enumerate(items):
            holders = held.get(ic, [])
            cw = cumw[it.bucket]
            t_one = p.ttab[(it.bucket, it.sp)][it.mbs] / it.mbs
            s0 = cursor[it.bucket]
            m = it.mbs
            rnd = 0
            order: list[int] = []  # the group of each of the class's micro-batches, in sample order
            while holders:
                # round by round, alternating direction and rotated per class, so each
                # group gets longer and shorter samples of the bucket
                gl = [g for g0, n, _ in holders for g in range(g0, g0 + n)]
                o = (ic * 7919) % len(gl)
                gl = gl[o:] + gl[:o]
                order.extend(gl if rnd % 2 == 0 else gl[::-1])
                rnd += 1
                holders = [h for h in holders if h[2] > rnd]
            starts = range(s0, s0 + m * len(order), m)
            cuts = cw[s0:s0 + m * len(order) + 1:m]
            w = cuts[1:] - cuts[:-1]
            lay, j = it.layout, it.bucket
            for g, a, wt, mw in zip(order, starts, (w * t_one).tolist(), (w / m).tolist()):
                chunks[g].append((range(a, a + m), lay, wt, j, mw))
            cursor[it.bucket] = s0 + m * len(order)
        of_k = {k: [g for g, kk in enumerate(sizes) if kk == k] for k in gclasses}
        for k in gclasses:
            refine(of_k[k], chunks)
        if spill(p, sizes, chunks):
            for k in gclasses:
                refine(of_k[k], chunks)
        predicted += max((sum(c[2] for c in g) for g in chunks), default=0.0)
        phases.append((sizes, chunks))
    assert all(cursor[j] == len(v) for j, v in members.items()), "every sample is planned once"
    return phases, predicted


def build_plan(p: ScalePlanner, step: Step, phases: Phases, num_tokens: int, members: dict[int, list[int]]
               ) -> StepPlan:
    """The step plan of an expansion: each phase's groups placed as aligned blocks (a
    micro-batch's samples are a range of its bucket's `members`)."""
    groups: list[GroupPlan] = []
    for phase, (sizes, chunks) in enumerate(phases):
        for g, r in enumerate(p.ctx.topology.tile(sizes)):
            mbs = tuple([MicroBatch(tuple(members[c[3]][c[0].start:c[0].stop]), c[1]) for c in chunks[g]]
                        ) if g < len(chunks) else ()
            groups.append(GroupPlan(r, mbs, phase))
    return StepPlan(step.index, step.sample_ids, tuple(groups), num_tokens)


def spill(p: ScalePlanner, sizes: list[int], chunks: list[list[tuple]], max_iter: int = 256) -> bool:
    """Local search across degrees: move a micro-batch off the slowest group of the phase to
    the least-loaded group of another SP degree, re-laid-out there (same samples, that
    degree's recompute for copies of the bucket's largest sample), while the slowest
    group's load falls."""
    if len(set(sizes)) < 2:
        return False
    moved = False
    loads = np.array([sum(c[2] for c in g) for g in chunks])
    deg = np.array(sizes)
    kinds = sorted(set(sizes))
    for _ in range(max_iter):
        a = int(np.argmax(loads))
        top = loads[a]
        best = None
        for k in kinds:
            if k == sizes[a]:
                continue
            masked = np.where(deg == k, loads, np.inf)
            z = int(np.argmin(masked))
            if loads[z] >= top:
                continue
            for i, c in enumerate(chunks[a]):
                j, m = c[3], len(c[0])
                if m > p.top[(j, k)]:
                    continue
                t_new = p.ttab[(j, k)][m] * c[4]
                new = max(top - c[2], loads[z] + t_new)
                if new < top * (1 - MIN_GAIN) and (best is None or new < best[0]):
                    best = (new, i, z, k, t_new)
        if best is None:
            return moved
        moved = True
        _, i, z, k, t_new = best
        c = chunks[a].pop(i)
        loads[a] -= c[2]
        lay = p._lt(c[3], len(c[0]), k)[0]
        chunks[z].append((c[0], lay, t_new, c[3], c[4]))
        loads[z] += t_new
    return moved


def refine(gs: list[int], chunks: list[list[tuple]],
            max_iter: int = 64) -> None:
    """Local search on the slowest group of one degree, with each micro-batch timed from its
    own samples: move a micro-batch to, or swap one with, the least-loaded group of that
    degree while the pair's larger load falls."""
    if len(gs) < 2:
        return
    loads = np.array([sum(c[2] for c in chunks[g]) for g in gs])
    mean = float(loads.mean())
    for _ in range(max_iter):
        a, z = int(np.argmax(loads)), int(np.argmin(loads))
        diff = loads[a] - loads[z]
        if diff <= loads[a] * MIN_GAIN or loads[a] <= mean * BALANCED:  # the slowest is within 0.1% of the mean
            return
        src, dst = chunks[gs[a]], chunks[gs[z]]
        ta = np.array([c[2] for c in src])
        tz = np.array([c[2] for c in dst] + [0.0])  # the 0 is a move instead of a swap
        gain = ta[:, None] - tz[None, :]
        score = np.where((gain > 0) & (gain < diff), np.abs(gain - diff / 2), np.inf)
        best = int(np.argmin(score))
        if not np.isfinite(score.flat[best]):
            return
        i, j = divmod(best, len(tz))
        moved = src.pop(i)
        if j < len(dst):
            src.append(dst.pop(j))
        dst.append(moved)
        loads[a] -= gain[i, j]
        loads[z] += gain[i, j]
