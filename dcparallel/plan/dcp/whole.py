"""`dcp`'s one-micro-batch-per-rank split (`WholeSplit`), for steps of a few samples per GPU
whose classes each hold samples of one size (video: one latent shape).

Where the step is shorter than two of the shortest micro-batches any rank can run (the launch
floor: 0.157 s for the video model on an H200), a rank runs one micro-batch: the step is then
each class's samples split into micro-batches of copies, each on its own group, as few ranks
as possible. For a makespan target T (compute), each class c takes, per degree k, micro-batches
of at most M_k(T) samples (the most copies of its size that finish within T at k); it is
split into micro-batches of its degree of fewest ranks per sample (k / M_k) and, where a part
is left, one more micro-batch at the degree of fewest ranks that holds it (or one more of the
first degree, the class's samples then spread evenly over them). The smallest T whose split
needs at most the world's ranks is bisected; each group runs its micro-batch at its degree.

On the scale report's strong 1024-GPU image-bucket steps (2.3 images per GPU over 85 shapes),
the per-sample packing runs the largest images at SP 2 in 0.28 s while a fifth of the ranks
idle; split whole, images of one shape share SP 4 and SP 8 micro-batches, and the step takes
its bound (0.299 s against 0.316-0.326 s).

Short names: c (a class), k (an SP degree), j (a degree index), M (per class and degree, the
most copies within T), T (a makespan target), tau (per class, degree and count, the time of
that many copies, made non-decreasing in the count).
"""

from __future__ import annotations

import numpy as np

from dcparallel.plan.dcp.packing import Group, Packing

#: the most copies of a class priced for one micro-batch
MAX_COPIES = 256
#: bisection steps of the target
BISECT_STEPS = 24


class WholeSplit:
    """The one-micro-batch-per-rank split of a step (`plan`), with a `SamplePacker`'s degrees,
    timing and placement (`SamplePacker.step_plan`)."""

    def __init__(self, packer):
        self.packer = packer
        self._tau: dict = {}  # per (size, degree index): the copies' times, non-decreasing, and how many priced

    def copies(self, sizes: list, ns: list[int], upto: int = MAX_COPIES) -> np.ndarray:
        """Per size and degree index, m = 1..`upto` copies of it (inf where they do not fit or m
        is past those priced), made non-decreasing in m: [size, degree index, m]. A size
        is priced when a step holds more of it than priced: up to 4 n, at least 32 and twice what
        was priced before, at most `MAX_COPIES` (a shape's count varies from step to step), all
        sizes of a degree at once, and cached (the step's shapes recur)."""
        p = self.packer
        for j, k in enumerate(p.sp):
            todo = {}
            for z, n in zip(sizes, ns):
                got = self._tau.get((z, j))
                if got is None or got[1] < min(n, MAX_COPIES):
                    todo[z] = min(max(4 * n, 2 * (0 if got is None else got[1]), 32), MAX_COPIES)
            if todo:
                for (z, top), raw in zip(todo.items(), p.ctx.copies_times(list(todo), list(todo.values()), k, p.mode)):
                    full = np.full(MAX_COPIES, np.inf)
                    full[:top] = raw
                    self._tau[(z, j)] = (np.maximum.accumulate(full), top)
        return np.stack([np.stack([self._tau[(z, j)][0][:upto] for j in range(len(p.sp))]) for z in sizes])

    def classes(self, ids: list[int]) -> tuple[list[list[int]], list] | None:
        """The step's classes (their sample ids, ascending, in class order) and each one's
        size; None where a class holds samples of several sizes (the split does not plan it)."""
        ctx = self.packer.ctx
        classes: dict = {}
        for i in ids:
            classes.setdefault(ctx.bucket_of[i], []).append(i)
        members = [sorted(v) for _, v in sorted(classes.items())]
        sizes = [ctx.sizes[m[0]] for m in members]
        if any(ctx.sizes[i] != z for m, z in zip(members, sizes) for i in m):
            return None
        return members, sizes

    def prepare(self, steps: list[list[int]]) -> None:
        """Prices ahead the copies (`copies`) the split of these steps reads, each size up to
        its largest count in them: the step that first reaches the split (most often an
        epoch's short last step, or its first) then prices nothing. `copies` keeps each size's
        priced counts as a prefix, the same whatever the order of the steps that price it,
        and the split reads at most a step's own count of it: plans are the same either way."""
        most: dict = {}
        for ids in steps:
            got = self.classes(ids)
            if got is None:
                continue
            for m, z in zip(*got):
                most[z] = max(most.get(z, 0), len(m))
        if most:
            self.copies(list(most), list(most.values()))

    def plan(self, ids: list[int]) -> Packing | None:
        """The split at the smallest target that needs at most the world's ranks, None where a
        class holds samples of several sizes or where no target under twice the shortest
        micro-batch fits (a rank could then run two, which this split does not plan)."""
        p = self.packer
        got = self.classes(ids)
        if got is None:
            return None
        members, sizes = got
        n = np.array([len(m) for m in members])
        # a class splits into micro-batches of at most its own count: more copies are not read
        tau = self.copies(sizes, n.tolist(), min(int(n.max()), MAX_COPIES))  # [c, j, m]
        lo = float(tau[:, :, 0].min(axis=1).max())  # the slowest class's single sample
        hi = 2 * float(tau[:, :, 0].min())
        if lo >= hi or self.ranks(tau, n, hi)[0] > p.world:
            return None
        for _ in range(BISECT_STEPS):
            mid = (lo + hi) / 2
            if self.ranks(tau, n, mid)[0] > p.world:
                lo = mid
            else:
                hi = mid
        return self.groups(members, *self.ranks(tau, n, hi)[1:])

    def ranks(self, tau: np.ndarray, n: np.ndarray, T: float):
        """The ranks the split at target T needs, and per class its main degree index, its
        micro-batches there, the degree index of the part left (-1: none) and the most copies
        within T at its main degree. (`tau` holds at least each class's count of copies, so
        M, the most within T and at most the count, reads no further.)"""
        kf = self.packer.kf
        M = np.minimum((tau <= T * (1 + 1e-12)).sum(axis=2), n[:, None])  # [c, j]
        per = np.where(M > 0, kf[None, :] / np.maximum(M, 1), np.inf)
        main = per.argmin(axis=1)
        rows = np.arange(len(n))
        full = np.where(np.isfinite(per[rows, main]), n // np.maximum(M[rows, main], 1), 0)
        left = n - full * M[rows, main]
        # the part left: one micro-batch at the fewest ranks that hold it, or one more of the main degree
        holds = np.where(M >= left[:, None], kf[None, :], np.inf)
        rest = holds.argmin(axis=1)
        one_more = (left > 0) & (kf[main] <= holds[rows, rest])
        rest = np.where((left > 0) & ~one_more, rest, -1)
        full = full + one_more
        cost = full * kf[main] + np.where(rest >= 0, holds[rows, np.maximum(rest, 0)], 0.0)
        if not np.isfinite(per[rows, main]).all():
            return np.inf, main, full, rest, M[rows, main]
        return float(cost.sum()), main, full, rest, M[rows, main]

    def groups(self, members: list[list[int]], main, full, rest, size) -> Packing:
        """The split's groups (widest first), each one micro-batch, and its predicted time:
        per class its micro-batches at its main degree (of `size` samples each where a part is
        left for another degree, else the class spread evenly over them), then that part."""
        p = self.packer
        items: list[tuple[tuple[int, ...], int]] = []  # (micro-batch, degree index)
        for ids, j, x, r, m in zip(members, main.tolist(), full.tolist(), rest.tolist(), size.tolist()):
            cut = x * m if r >= 0 else len(ids)
            ends = np.linspace(0, cut, x + 1).round().astype(int).tolist()
            items += [(tuple(ids[a:b]), j) for a, b in zip(ends[:-1], ends[1:])]
            if r >= 0:
                items.append((tuple(ids[cut:]), r))
        t = p.times([it for it, _ in items])
        groups = []
        for (it, j), row in zip(items, t):
            fin = float(row[j]) + p.exposed(float(row[j]))
            groups.append(Group(p.sp[j], fin, [it], []))
        groups.sort(key=lambda g: (-g.sp, -g.finish, g.items[0]))
        return Packing(groups, max(g.finish for g in groups))
