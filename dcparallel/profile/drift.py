"""Load drift during a profile: a fixed reference run, timed in every round, puts every layout
on the same clock.

A profile takes minutes; on a shared machine the load changes over them, and every layout's
time carries the load of the moment it was measured: small layouts timed while the machine
was idle and large ones while it was busy price a small micro-batch several times too cheap
relative to a large one (seen on 2 shared cores: the same one-sample layout measured 11, 18
and 40 ms within minutes). Repeating rounds inside a layout cannot remove that; a reference
can. `ReferenceClock` times one fixed run (the smallest bucket, one sample, SP 1, one layer)
once per round of every layout; a layout's reference time is the median of the reference runs
of its rounds (at least the last `MIN_WINDOW` of this rank, so a layout of few rounds is not
judged by one run). `rescale` then multiplies each entry's time by ``reference / its
reference time``, where ``reference`` is the median over the whole profile: every entry is
priced at the profile's typical machine speed, and the ratio of any two entries is what it
would have been had both been measured at the same moment.

What it cannot do: tell the speed the machine will have later. A profile measured while the
machine was 2x busier than during training still predicts 2x too long; the reference time is
kept in the profile (`Profile.reference_s`) so that a run can be compared against it.

What it gets wrong: the reference run is slowed by the work just before it, not only by the
machine's load. On 2 CPU ranks (gloo, one thread each) it took 4.9-6.1 ms (median per profile)
between the rounds of SP 1 layouts and 6.3-7.0 ms between those of SP 2 layouts, and longer
rounds slowed it more (4.5 ms after the shortest SP 1 rounds, 6.0 ms after the longest); a
bare 1 MiB all-to-all before it slowed it from 3.3-3.8 to 4.7-5.5 ms. Rescaling divides each
entry by that too: in five demo profiles it lowered the SP 2 entries of the largest
micro-batches by up to 16%, and re-pricing the plans those runs executed put the worst
prediction 18.2% off rescaled against 14.4% without. So rescaling pays where the load drifts by
more than that (a shared machine); on a quiet one `ProfilerConfig.rescale` = False keeps the
reference as a record of the machine's speed only (`median_reference`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from dcparallel.cost.schema import ProfileEntry

#: a layout's reference time is the median of at least this many of the latest reference runs
MIN_WINDOW = 5


class ReferenceClock:
    """Times ``run`` (one reference run, returns its seconds) on `tick`; `since(mark)` is the
    reference time of what ran after ``mark`` (see the module docstring)."""

    def __init__(self, run: Callable[[], float]):
        self._run = run
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(self._run())

    def mark(self) -> int:
        return len(self.times)

    def since(self, mark: int) -> float | None:
        """The median reference time of the runs since ``mark``, widened to the last
        `MIN_WINDOW` runs; None before any run."""
        window = self.times[min(mark, max(0, len(self.times) - MIN_WINDOW)) :]
        return float(statistics.median(window)) if window else None


def _timed(entries: Sequence[ProfileEntry]) -> list[ProfileEntry]:
    return [e for e in entries if e.measured and e.measured.get("reference_s")]


def median_reference(entries: Sequence[ProfileEntry]) -> float | None:
    """The median of the entries' reference times (``measured["reference_s"]``); None: no entry has one."""
    timed = _timed(entries)
    return float(statistics.median(e.measured["reference_s"] for e in timed)) if timed else None


def rescale(entries: Sequence[ProfileEntry]) -> float | None:
    """Puts every timed entry (``measured["reference_s"]`` set) on the profile's median
    reference time: ``time_s`` and a full-depth validation's time are multiplied by
    ``reference / reference_s`` (kept as ``measured["load_scale"]``; the short stacks'
    ``measured["time_s"]`` stay as measured). Returns the reference (None: no entry has one)."""
    ref = median_reference(entries)
    if ref is None:
        return None
    for e in _timed(entries):
        scale = ref / e.measured["reference_s"]
        e.measured["load_scale"] = scale
        if e.time_s is not None:
            e.time_s *= scale
        if e.validation and "time_s" in e.validation:
            e.validation["time_s"] *= scale
    return ref
