"""`dcp`'s class-level search over makespan targets: candidate layouts per (class, count),
and per target T the layout of least GPU-seconds of every class whose micro-batches finish
within T (`tables.least_gpu_seconds_within`), if the groups those need fit the world.

The candidate rows of a step's classes are one array (`table`), a segment per class, least
GPU-seconds first. A *problem* is a part of the step's classes (one phase: the whole step,
or one side of a two-phase split) with a smallest allowed SP degree and a cap fraction f; a
target's choice is, per class of the part, its first row with SP at least that degree and
time <= f T (f < 1: shorter micro-batches, which share groups where f = 1 would give most of
them a group each). Every target
of every problem of a search pass is evaluated in one batch of array operations (`fits`), by
counting per class the leading rows whose running minimum time exceeds each target; times
are compared as integer ranks among the step's distinct times, so problems stack exactly.

Short names: p (the `tables.LayoutTable`), tab (the step's `StepTable`), j (a class: an
index into the table's planning classes), c (a sample count, or a `Candidate`), k (an SP
degree), ki (a smallest allowed degree, as an index into `p.sp`), kpos (a row's degree
index), m (a micro-batch size), t (a micro-batch time), T (a makespan target), frac (a cap
fraction), q (a part's index among the parts searched), seg (a problem's class segment),
rr / pp (the choosable rows and their problems), x / y (a problem's index among all / the
live ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from dcparallel.plan.dcp.classes import cut_starts
from dcparallel.plan.dcp.tables import LayoutTable, Row
from dcparallel.plan.types import ROUND_EPS


@dataclass
class StepTable:
    """A step's candidate rows (`table`) as arrays, one segment per class, least GPU-seconds
    first, and what the search reads from them."""

    a: np.ndarray  #: the rows, one per line (`Row(*a[i])`), times scaled by the step's weights
    cols: Row  #: the columns of `a` by name (views)
    t: np.ndarray  #: each row's full micro-batch time
    full: np.ndarray  #: full micro-batches per row
    tr: np.ndarray  #: the rest's time (0 without a rest)
    tot: np.ndarray  #: busy seconds per row
    items: np.ndarray  #: micro-batches per row
    kpos: np.ndarray  #: each row's degree, as an index into the planner's degrees
    starts: np.ndarray  #: each class's first row
    n: int  #: rows
    seg: np.ndarray  #: each row's class position
    lens: np.ndarray  #: rows per class
    spf: np.ndarray  #: the degrees, as floats
    present: list[int]  #: the classes (class indices), in table order
    times: np.ndarray  #: the step's distinct row times, ascending
    rank: np.ndarray  #: each row's time as a rank among `times`
    least: np.ndarray  #: per class and smallest degree index: the least time at that degree or wider
    stair_rows: list[np.ndarray]  #: per smallest degree index: the rows some target can choose
    area: list[float]  #: per class: its least GPU-seconds
    longest: list[float]  #: per class: its least time
    gpu_t: np.ndarray  #: each row's GPU-seconds at the class level's times
    least_gpu_t: np.ndarray  #: per class and smallest degree index: the least of `gpu_t` there
    floor_slack: float  #: the floors are lowered by this fraction (`DcpConfig.floor_slack`)
    #: the cap fractions the step is searched with (`search`'s `fracs`)
    fracs: tuple[float, ...] = (1.0,)
    #: allocations made, by (part, rows, groups needed): the same choice found again, same plan
    allocated: dict = field(default_factory=dict)


def rows(p: LayoutTable, j: int, c: int) -> np.ndarray:
    """Candidate layouts of `c` samples of class j, least GPU-seconds first, one row each
    (`Row`: GPU-seconds, degree, micro-batch size, a full micro-batch's time, how many,
    the time of the rest, its samples, busy seconds). Micro-batch sizes per degree: powers of
    two and even splits of c (c / 1, c / 2, c / 4, ... rounded up), capped at the most that
    fit. Cached per planner."""
    return p.rows_many([(j, c)])[0]


def table(p: LayoutTable, present: list[int], counts: list[int], scale: dict[int, tuple[float, float]]) -> StepTable:
    """The candidate rows of a step's classes as arrays, one segment per class, their times
    scaled by the class's mean weight in this step; each row's time as a rank among the
    step's distinct times; per class its least GPU-seconds (`part_bound`), and per class
    and smallest allowed degree its least time and least GPU-seconds at the class level's
    times (`plan_floor`)."""
    arrs = p.rows_many(list(zip(present, counts)))
    lens = [len(x) for x in arrs]
    a = np.concatenate(arrs)
    c = Row(*a.T)  # the columns by name, views of a
    f = np.repeat(np.array([scale[j][0] for j in present]), lens)
    fmax = np.repeat(np.array([scale[j][1] for j in present]), lens)
    for col in (c.gpu_s, c.total):  # work: the class's mean weight
        col *= f
    for col in (c.t_full, c.t_rem):  # a micro-batch's time: its longest samples could land in any one
        col *= fmax
    # each row's GPU-seconds at those times: what its micro-batches add to a class-level plan
    gpu_t = (c.full * c.t_full + c.t_rem) * c.k
    pos = np.zeros(max(p.sp) + 1, dtype=np.int64)
    pos[p.sp] = np.arange(len(p.sp))
    starts = np.cumsum([0] + lens[:-1])
    seg = np.repeat(np.arange(len(lens)), lens)
    t = c.t_full
    times, rank = np.unique(t, return_inverse=True)
    rank = rank.reshape(-1)
    kpos = pos[c.k.astype(np.int64)]
    # per class and smallest degree: the least time of its rows at that degree or wider,
    # and their least GPU-seconds at those times
    least, least_gpu_t = (_least_at(x, seg, kpos, (len(lens), len(p.sp))) for x in (t, gpu_t))
    # per smallest degree, the rows some target can choose: each class's rows at that degree
    # or wider that are faster than every row before them (a row is chosen for T iff it is
    # the first such row with time <= T)
    big = len(times) + 1
    v = np.where(kpos[None, :] >= np.arange(len(p.sp))[:, None], rank[None, :], big)
    shift = (len(lens) - seg) * (big + 1)  # later classes lower: one running minimum per class
    run = np.minimum.accumulate(v + shift, axis=1) - shift
    prev = np.full_like(run, big)
    prev[:, 1:] = run[:, :-1]
    prev[:, starts] = big
    stair = v < prev
    return StepTable(
        a=a,
        cols=c,
        t=t,
        full=c.full,
        tr=c.t_rem,
        tot=c.total,
        items=c.full + (c.rem > 0),
        kpos=kpos,
        starts=starts,
        n=len(a),
        seg=seg,
        lens=np.asarray(lens),
        spf=np.asarray(p.sp, dtype=float),
        present=list(present),
        times=times,
        rank=rank,
        least=least,
        stair_rows=[np.flatnonzero(x) for x in stair],
        area=np.minimum.reduceat(c.gpu_s, starts).tolist(),
        longest=least[:, 0].tolist(),
        gpu_t=gpu_t,
        least_gpu_t=least_gpu_t,
        floor_slack=p.config.floor_slack,
    )


def _least_at(x: np.ndarray, seg: np.ndarray, kpos: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Per class and smallest degree index, the least x of its rows at that degree or wider."""
    out = np.full(shape, np.inf)
    np.minimum.at(out, (seg, kpos), x)
    return np.minimum.accumulate(out[:, ::-1], axis=1)[:, ::-1]


def part_bound(tab: StepTable, part: Sequence[int], world: int) -> float:
    """The class-level bound of a part's classes (positions in the table) in one phase:
    max(least GPU-seconds / world, the longest least micro-batch time). No plan of theirs is
    predicted below it."""
    area = longest = 0.0
    for i in part:
        area += tab.area[i]
        longest = max(longest, tab.longest[i])
    return max(area / world, longest)


def plan_floor(tab: StepTable, part: Sequence[int], world: int, ki: int = 0) -> float:
    """No class-level plan of a part's classes (positions in the table) with every class at
    the `ki`-th degree or wider is predicted below this: its groups' largest load is at least
    their mean, and at least any micro-batch's time. Unlike `part_bound`, it counts work at
    the class level's times (each micro-batch timed for the class's heaviest samples). It
    only rises with `ki`; slightly lowered against rounding."""
    return _floor(float(tab.least_gpu_t[part, ki].sum()), float(tab.least[part, ki].max()), world, tab.floor_slack)


def rows_floor(tab: StepTable, first: np.ndarray, world: int) -> float:
    """`plan_floor` of one layout choice (the table's rows `first`): no allocation of it is
    predicted below this."""
    return _floor(float(tab.gpu_t[first].sum()), float(tab.t[first].max()), world, tab.floor_slack)


def expanded_floors(p: LayoutTable, parts, ss) -> list[float]:
    """Per phase, a time no expansion of this class-level plan (`expand.expand` of `parts`,
    with the step's samples `ss`) predicts it below, before `config.floor_slack` (against
    rounding; `expanded_floor` applies it). A phase's groups' largest load is at least
    their mean weighted by size, which is their GPU-seconds over their ranks; a micro-batch
    costs at least its least GPU-seconds at any degree of the phase (refining moves it within
    its degree, spilling to another degree of the phase, re-timed there). A micro-batch of m
    samples of class b at degree k takes t(b, k, m) / m times its samples' weights, so an
    item class's least GPU-seconds are min_k k t(b, k, m) / m times the weights of the
    samples `expand` cuts it from (`classes.cut_starts`)."""
    cursor: dict[int, int] = {}
    out = []
    cumw = ss.cumw
    for part in parts:
        items, (by_k, count) = part.items, part.groups
        kinds = tuple(sorted(by_k))
        least = p.least_gpu(kinds)
        work = 0.0
        for it, at in zip(items, cut_starts(items, cursor)):
            lo, n = ss.base[it.pclass] + at, it.count * it.mbs
            work += least[it.pclass][it.mbs] * float(cumw[lo + n] - cumw[lo])
        out.append(work / sum(k * count[k] for k in kinds))
    return out


def expanded_floor(p: LayoutTable, floors: Sequence[float]) -> float:
    """No expansion of a plan with these phase `expanded_floors` is predicted below their sum (lowered a little)."""
    return sum(floors) * (1 - p.config.floor_slack)


def _floor(work: float, longest: float, world: int, slack: float) -> float:
    """max(GPU-seconds / world, the longest micro-batch), lowered by the fraction `slack`."""
    return max(work / world, longest) * (1 - slack)


def fits(
    p: LayoutTable,
    tab: StepTable,
    problems: list[tuple[Sequence[int], int]],
    targets: list[np.ndarray],
    fracs: Sequence[float] | None = None,
):
    """For every problem (a part's class positions, in table order, and the index of its
    smallest allowed degree in `p.sp`) and each of its sorted targets (ranks into
    `tab.times`; ``len(times)`` is T infinite): whether the choice fits the world, the
    chosen rows and the groups they need per SP degree.

    Returns (fit [problem, target], first [segment, target] row indices, need [problem,
    target, degree index], each problem's first segment); a problem's segments are its
    classes in order. Targets past a problem's own count are padding. A target is a cap C on
    the micro-batches' time and, with `fracs` (per problem, default 1), the makespan T =
    C / frac: a class's row is its first row with SP >= the smallest degree and time <= C;
    the groups a degree needs are its work over T, at least one per micro-batch longer than
    T / 2, at most one per micro-batch (0 for a degree without micro-batches)."""
    nk, num = len(p.sp), len(problems)
    nts = np.array([len(x) for x in targets])
    ntmax = int(nts.max())
    inpart = np.zeros((num, len(tab.lens)), dtype=bool)
    for q, (part, _) in enumerate(problems):
        inpart[q, part] = True
    kis = [ki for _, ki in problems]
    # each problem's choosable rows (`table`'s "stair_rows"): per class, times strictly falling
    each = [tab.stair_rows[ki] for ki in kis]
    rr = np.concatenate(each)
    pp = np.repeat(np.arange(num), [len(x) for x in each])
    keep = inpart[pp, tab.seg[rr]]
    pp, rr = pp[keep], rr[keep]
    bkt = tab.seg[rr]
    brk = np.ones(len(rr), dtype=bool)
    brk[1:] = (pp[1:] != pp[:-1]) | (bkt[1:] != bkt[:-1])
    sstart = np.flatnonzero(brk)
    nseg = len(sstart)
    assert nseg == sum(len(part) for part, _ in problems), "every class of a problem has a row to choose"
    seg = np.cumsum(brk) - 1
    slen = np.diff(np.append(sstart, len(rr)))
    sprob = pp[sstart]
    pfirst = np.searchsorted(sprob, np.arange(num))
    # each row's count of its problem's targets below its time (ranks offset per problem)
    off = len(tab.times) + 2
    tall = np.concatenate(targets)
    tstart = np.cumsum(nts) - nts
    r = np.searchsorted(tall + np.repeat(np.arange(num) * off, nts), pp * off + tab.rank[rr]) - tstart[pp]
    hist = np.bincount(seg * (ntmax + 1) + r, minlength=nseg * (ntmax + 1)).reshape(nseg, ntmax + 1)
    above = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1][:, 1:]  # [segment, j]: rows slower than target j
    ok = np.logical_and.reduceat(above < slen[:, None], pfirst, axis=0)
    # (gathers by a 2-D index take() or go flat: numpy's fancy indexing is slow there)
    first = rr.take(sstart[:, None] + np.minimum(above, slen[:, None] - 1))
    fr = first.ravel()
    # each problem's targets as times, padded with its last
    j = np.minimum(np.arange(ntmax)[None, :], nts[:, None] - 1)
    T = np.append(tab.times, math.inf).take(tall.take(tstart[:, None] + j))  # [problem, j]
    if fracs is not None:
        T = T / np.asarray(fracs, dtype=float)[:, None]
    half = (T.take(sprob, axis=0) / 2).ravel()  # [segment, j], flat
    flat = ((sprob[:, None] * ntmax + np.arange(ntmax)[None, :]) * nk).ravel() + tab.kpos[fr]
    size = num * ntmax * nk
    work = np.bincount(flat, weights=tab.tot[fr], minlength=size).reshape(num, ntmax, nk)
    # micro-batches longer than T / 2 (the rest's time is 0 where there is no rest)
    big = tab.full[fr] * (tab.t[fr] > half) + (tab.tr[fr] > half)
    bigk = np.bincount(flat, weights=big, minlength=size).reshape(num, ntmax, nk)
    items = np.bincount(flat, weights=tab.items[fr], minlength=size).reshape(num, ntmax, nk)
    need = np.minimum(items, np.maximum(np.maximum(1.0, bigk), np.ceil(work / T[:, :, None] - ROUND_EPS)))
    need = np.where(items > 0, need, 0.0)
    return ok & (need @ tab.spf <= p.world), first, need, pfirst


def rows_at(tab: StepTable, first: np.ndarray) -> list[Row]:
    """The table's rows `first` (counts as ints)."""
    return [
        Row(g, int(k), int(m), t, int(full), tr, int(rem), tot)
        for g, k, m, t, full, tr, rem, tot in tab.a[first].tolist()
    ]


class Problem(NamedTuple):
    """One problem of a search pass: a part (class positions in the table), the index of its
    smallest allowed degree, the part's index among the searched parts, and the cap fraction."""

    part: np.ndarray
    ki: int
    q: int
    frac: float


class Candidate(NamedTuple):
    """A layout choice the search found: its makespan target T (its micro-batches' cap over
    the cap fraction), the chosen row of each of the part's classes (`rows_at` gives them as
    tuples) and the groups it needs per SP degree (an array over the planner's degrees; `needs`
    gives it as a dict)."""

    T: float
    first: np.ndarray
    need: np.ndarray


def search(
    p: LayoutTable,
    tab: StepTable,
    parts: list[Sequence[int]],
    degrees: range | None = None,
    fracs: Sequence[float] = (1.0,),
    known: list[list[list[Candidate]]] | None = None,
) -> list[list[list[Candidate]]]:
    """Per part (class positions in the table, in table order) and per smallest allowed SP
    degree (the indices `degrees` into `p.sp`, all by default): layouts at the smallest
    feasible target and at a few larger ones, for each cap fraction `fracs` (in order, the
    first 1; distinct choices only). Targets are the part's distinct micro-batch times at that
    degree or wider, from the longest of its classes' least times, taken as caps C with the
    makespan C / fraction (`fits`); a coarse pass over `config.search_coarse` of them brackets the
    smallest that fits, a second pass over the bracket (a chunk at a time: `_first_fitting`)
    finds it and the candidates after it.
    If none fits at fraction 1: least work (T infinite), if that fits. All parts, degrees and
    fractions are searched together, one batch per pass; each (part, degree) alone gives the
    same candidates. `known`: what a search of the same parts and degrees at the fractions before
    `fracs` found; the result extends it as if those fractions had been searched again here."""
    degrees = range(len(p.sp)) if degrees is None else degrees
    out: list[list[list[Candidate]]] = (
        [[list(x) for x in per] for per in known] if known else [[[] for _ in degrees] for _ in parts]
    )
    problems, ranks = _problems(tab, parts, degrees, fracs)
    if not problems:
        return out
    grids = [_coarse(len(r), p.config.search_coarse) for r in ranks]
    fit = fits(
        p,
        tab,
        [(pr.part, pr.ki) for pr in problems],
        [r[g] for r, g in zip(ranks, grids)],
        [pr.frac for pr in problems],
    )[0]
    windows = _windows(fit, grids, ranks, max(p.config.candidate_offsets))
    got: list[list[Candidate]] = [[] for _ in problems]
    _first_fitting(p, tab, problems, ranks, windows, got)
    _least_work(p, tab, problems, windows, got)
    seen: dict[tuple[int, int], set] = {}
    for pr, cands in zip(problems, got):  # a (part, degree)'s fractions in order
        ki = pr.ki
        mine = seen.get((pr.q, ki))
        if mine is None:
            mine = seen[pr.q, ki] = {c.first.tobytes() for c in out[pr.q][ki - degrees.start]}
        for c in cands:
            sig = c.first.tobytes()  # a class's rows are distinct (degree, size) pairs
            if sig not in mine:
                mine.add(sig)
                out[pr.q][ki - degrees.start].append(c)
    return out


def _problems(
    tab: StepTable, parts: list[Sequence[int]], degrees: range, fracs: Sequence[float]
) -> tuple[list[Problem], list[np.ndarray]]:
    """The problems of a search pass (a part, each smallest degree in `degrees` at which every
    class of the part has a row, each cap fraction) and each one's targets: the part's
    distinct times (ranks into `tab.times`) at that degree or wider, from its floor up."""
    problems, ranks = [], []
    for q, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        floor = tab.least[part].max(axis=0)  # per smallest degree
        live = np.flatnonzero(np.isfinite(floor))
        live = live[(live >= degrees.start) & (live < degrees.stop)]
        if not len(live):
            continue
        if len(part) < len(tab.lens):
            mine = np.zeros(len(tab.lens), dtype=bool)
            mine[part] = True
            rows_q = mine[tab.seg].nonzero()[0]
        else:
            rows_q = np.arange(tab.n)
        hit = (tab.kpos[rows_q][None, :] >= live[:, None]) & (tab.t[rows_q][None, :] >= floor[live][:, None])
        mark = np.zeros((len(live), len(tab.times)), dtype=bool)
        li, ri = np.nonzero(hit)
        mark[li, tab.rank[rows_q][ri]] = True
        for x, ki in enumerate(live.tolist()):
            for frac in fracs:
                problems.append(Problem(part, ki, q, frac))
                ranks.append(mark[x].nonzero()[0])
    return problems, ranks


def _windows(fit: np.ndarray, grids: list[np.ndarray], ranks: list[np.ndarray], last_offset: int) -> list:
    """Per problem, the positions among its targets the second pass tries (None where no
    target of the coarse pass fits): from after the last coarse target that does not fit to
    the last candidate offset after the first that does."""
    windows = []
    for x, g in enumerate(grids):
        f = fit[x, : len(g)]
        if not f.any():
            windows.append(None)
            continue
        i = int(f.argmax())
        lo = int(g[i - 1]) + 1 if i > 0 else 0
        windows.append(np.arange(lo, min(len(ranks[x]), int(g[i]) + last_offset + 1)))
    return windows


def _first_fitting(
    p: LayoutTable, tab: StepTable, problems: list[Problem], ranks: list[np.ndarray], windows: list, got: list
) -> None:
    """Adds to `got` each problem's candidates in its window: the first target that fits and
    those `config.candidate_offsets` after it that fit. The windows are tried from their
    start, `config.search_coarse` targets at a time, all problems together: a problem is done
    once its first fitting target and the last offset after it are tried (its window's first
    half or less, most often), so the rest of its window is not. Each target's outcome is
    the same however many are tried with it (`fits` decides each on its own)."""
    last = max(p.config.candidate_offsets)
    size = p.config.search_coarse
    pending = [x for x, w in enumerate(windows) if w is not None]
    tried: dict[int, list] = {x: [] for x in pending}  # per problem: (fit, first, need) per chunk
    hit: dict[int, int] = {}  # per problem: its first fitting target's position in its window, once found
    at = 0
    while pending:
        fit, first, need, pfirst = fits(
            p,
            tab,
            [(problems[x].part, problems[x].ki) for x in pending],
            [ranks[x][windows[x][at : at + size]] for x in pending],
            [problems[x].frac for x in pending],
        )
        going = []
        for y, x in enumerate(pending):
            n = min(size, len(windows[x]) - at)
            part = problems[x].part
            tried[x].append((fit[y, :n], first[pfirst[y] : pfirst[y] + len(part), :n], need[y, :n]))
            if x not in hit and fit[y, :n].any():
                hit[x] = at + int(fit[y, :n].argmax())
            if at + n < len(windows[x]) and hit.get(x, at + n) + last >= at + n:
                going.append(x)  # the first fit or an offset after it lies further on
        pending = going
        at += size
    for x, at in hit.items():  # (a problem with no fitting target has no candidates)
        chunks = tried[x]
        f = np.concatenate([c[0] for c in chunks])
        first = np.concatenate([c[1] for c in chunks], axis=1)
        need = np.concatenate([c[2] for c in chunks])
        for i in (at + d for d in p.config.candidate_offsets):
            if i < len(f) and f[i]:
                T = float(tab.times[ranks[x][windows[x][i]]]) / problems[x].frac
                got[x].append(Candidate(T, first[:, i], need[i]))


def _least_work(p: LayoutTable, tab: StepTable, problems: list[Problem], windows: list, got: list) -> None:
    """Adds to `got`, for each problem at fraction 1 where no target fits, its choice at T
    infinite (least work), if that fits."""
    rest = [x for x, w in enumerate(windows) if w is None and problems[x].frac == 1.0]
    if not rest:
        return
    # T infinite: the cap is infinite whatever its fraction
    fit, first, need, pfirst = fits(
        p, tab, [(problems[x].part, problems[x].ki) for x in rest], [np.array([len(tab.times)]) for _ in rest]
    )
    for y, x in enumerate(rest):
        if fit[y, 0]:
            got[x].append(Candidate(math.inf, first[pfirst[y] : pfirst[y] + len(problems[x].part), 0], need[y, 0]))


def _coarse(n: int, coarse: int) -> np.ndarray:
    """The positions of the coarse pass among n sorted targets: `coarse` of them,
    evenly spread (i * (n - 1) / (coarse - 1), rounded down), the first and the last
    included."""
    if n <= coarse:
        return np.arange(n)
    # spaced more than 1 apart, so the positions are distinct
    out = (np.arange(coarse) * ((n - 1) / (coarse - 1))).astype(np.int64)
    out[-1] = n - 1
    return out


def needs(p: LayoutTable, need: np.ndarray) -> dict[int, int]:
    """A `Candidate`'s groups per SP degree, degrees without groups left out."""
    return {k: int(n) for k, n in zip(p.sp, need.tolist()) if n > 0}
