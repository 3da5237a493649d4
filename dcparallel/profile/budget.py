"""The wall-time budget of a profile (`ProfilerConfig.budget_s`), enforced, and its estimate.

Each rank measures its layout chains — (bucket, SP degree, recompute mode) — in the order of
`config.group_buckets`: small buckets first. Before each chain `Budget.level` says how to
measure it, from the time spent and what the rest would cost:

* FULL, as configured, while the chain measured fully plus every later chain measured
  coarsely still fits the budget (a reserve is kept for the large buckets that come last);
* COARSE: one micro-batch size, recompute none / full only, one timed round, while that
  fits the budget;
* SKIP otherwise: the chain is not measured. `cost.profiled` prices what was not measured
  from the buckets that were (interpolated, or proportionally in tokens beyond the largest
  measured), and the planners do not use a recompute mode measured nowhere. Only recompute
  none and full at an SP degree where neither was measured yet are measured regardless
  (coarsely: what a cost model needs at all).

Within a chain no layout (a micro-batch size, a ring split) starts whose estimate
(`Budget.fits`, the same estimate the progress bar sums) would end past the budget. A
profile therefore ends within its budget as far as its estimates hold (and past it only by
the chains a cost model needs at all, when the budget is shorter than them).

What a chain costs is estimated from what this rank measured: the seconds of one run of the
short stacks (both depths, one sample: `ProfileEntry.measured["time_s"]`) at each bucket
measured, extended to larger buckets as a power of their tokens (between 1 and 2, fitted on
the two largest measured), times the samples a chain runs (a full chain doubles its
micro-batch up to its largest size M: 1 + 2 + ... + M = 2M - 1 samples; a coarse one runs
one), times the median ratio of a chain's wall time to that product seen so far
(separately for full and coarse chains). The estimate of the whole profile measured fully
(`Budget.estimate`) is what the progress bar shows from the first chain on.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence

from dcparallel.cost.schema import ProfileEntry

Chain = tuple[str, int, str]
"""(bucket key, SP degree, recompute mode)"""

#: the recompute modes a coarse chain measures
COARSE_MODES = ("none", "full")

FULL, COARSE, SKIP = 0, 1, 2
#: a coarse chain's wall time in runs of both short stacks before one was seen: a memory run
#: and one timed round of each depth, plus building its inputs
COARSE_RUNS = 2.5


def largest_mbs(tokens: int, max_mbs: int, max_tokens: int | None) -> int:
    """The largest micro-batch a full chain of a bucket of ``tokens`` may reach (`ProfilerConfig`'s caps)."""
    m = 1
    while 2 * m <= max_mbs and (max_tokens is None or 2 * m * tokens <= max_tokens):
        m *= 2
    return m


def _now() -> float:
    return time.perf_counter()


class Budget:
    """``seconds`` of wall time (None: no budget) for ``chains``, this rank's chains in the
    order measured, each with its bucket's tokens and the largest micro-batch a full chain
    may reach; ``full_runs``: a full chain's wall time in runs of both short stacks per
    sample, until one was seen."""

    def __init__(self, seconds: float | None, chains: Sequence[tuple[Chain, int, int]], full_runs: float):
        self.seconds = seconds
        self.start = _now()
        self.chains = list(chains)
        self.index = {c[0]: i for i, c in enumerate(self.chains)}
        self.runs: dict[int, dict[int, float]] = {}  # sp -> tokens -> seconds of one run of both stacks
        self.ratio: dict[bool, list[float]] = {False: [], True: []}  # coarse? -> chain wall / run
        self.default_ratio = {False: full_runs, True: COARSE_RUNS}
        self.coarse, self.skipped = 0, 0
        self.covered: set[tuple[int, str]] = set()  # (sp, mode) with a chain measured
        self.full_s: dict[int, float] = {}  # chain index -> wall seconds, of the chains measured fully

    def elapsed(self) -> float:
        return _now() - self.start

    def run_s(self, sp: int, tokens: int) -> float | None:
        """Estimated seconds of one sample's run of both short stacks at degree ``sp`` (None: nothing measured)."""
        seen = self.runs.get(sp) or next((v for v in self.runs.values() if v), None)
        if not seen:
            return None
        if tokens in seen:
            return seen[tokens]
        ks = sorted(seen)
        below = [k for k in ks if k < tokens]
        k1 = below[-1] if below else ks[0]
        power = 1.0
        if len(ks) >= 2 and below:
            k0 = ks[ks.index(k1) - 1] if ks.index(k1) > 0 else ks[1]
            if k0 != k1 and seen[k0] > 0 and seen[k1] > 0:
                power = math.log(seen[k1] / seen[k0]) / math.log(k1 / k0)
        return seen[k1] * (tokens / k1) ** min(2.0, max(1.0, power))

    def layout_s(self, i: int, samples: int, coarse: bool) -> float:
        """Estimated wall seconds of ``samples`` samples of chain ``i`` measured coarsely or fully
        (0 when nothing is known yet)."""
        (_, sp, _), tokens, _ = self.chains[i]
        run = self.run_s(sp, tokens)
        if run is None:
            return 0.0
        seen = self.ratio[coarse]
        ratio = statistics.median(seen) if seen else self.default_ratio[coarse]
        return run * samples * ratio

    def cost(self, i: int, coarse: bool) -> float:
        """Estimated wall seconds of chain ``i`` measured coarsely or fully (0 when nothing is known yet,
        or a coarse chain of a mode coarse chains skip)."""
        (_, _, mode), _, largest = self.chains[i]
        if coarse and mode not in COARSE_MODES:
            return 0.0
        return self.layout_s(i, 1 if coarse else 2 * largest - 1, coarse)

    def fits(self, chain: Chain, mbs: int, coarse: bool) -> bool:
        """Whether a layout of ``chain`` at micro-batch size ``mbs`` (coarse: one round) is estimated
        to end within the budget (always, with no budget)."""
        if self.seconds is None:
            return True
        return self.elapsed() + self.layout_s(self.index[chain], mbs, coarse) <= self.seconds

    def level(self, chain: Chain) -> int:
        """FULL, COARSE or SKIP for ``chain`` now (the caller's group takes its ranks' largest)."""
        if self.seconds is None:
            return FULL
        i = self.index[chain]
        reserve = sum(self.cost(j, True) for j in range(i + 1, len(self.chains)))
        if self.elapsed() + self.cost(i, False) + reserve <= self.seconds:
            return FULL
        needed = chain[1:] not in self.covered and chain[2] in COARSE_MODES  # measured nowhere yet at this degree
        return COARSE if needed or self.elapsed() + self.cost(i, True) <= self.seconds else SKIP

    def seen(self, sp: int, tokens: int, entry: ProfileEntry) -> None:
        """A layout just measured: one sample's run of both short stacks, for the estimates from now on."""
        if entry.mbs == 1 and entry.feasible and entry.measured.get("time_s"):
            run = sum(entry.measured["time_s"])
            self.runs.setdefault(sp, {})[tokens] = max(run, self.runs.get(sp, {}).get(tokens, 0.0))

    def done(self, chain: Chain, level: int | None, seconds: float, entries: Sequence[ProfileEntry]) -> None:
        """``chain`` was measured at ``level`` in ``seconds`` (``entries``: its layouts on this
        rank), skipped (SKIP, or COARSE for a mode coarse chains skip), or brought back from the
        journal (None)."""
        (_, sp, mode), tokens, largest = self.chains[self.index[chain]]
        if level == SKIP or level == COARSE and mode not in COARSE_MODES:
            self.skipped += 1
            return
        self.coarse += level == COARSE
        self.covered.add((sp, mode))
        if level == FULL:
            self.full_s[self.index[chain]] = seconds
        one = [e for e in entries if e.mbs == 1 and e.feasible and e.measured.get("time_s")]
        if one:
            self.seen(sp, tokens, one[0])
            run = sum(one[0].measured["time_s"])
            if run > 0 and level is not None:
                samples = 1 if level == COARSE else 2 * max(e.mbs for e in entries) - 1
                self.ratio[level == COARSE].append(seconds / (run * samples))

    def progress_bar(self, name: str, rank: int):
        """A tqdm bar on stderr, shown on rank 0: the budget, then the chains and the estimate (`show`)."""
        from tqdm import tqdm

        limit = f", budget {self.seconds:.0f} s" if self.seconds is not None else ""
        return tqdm(
            total=len(self.chains),
            desc=f"profiling {name}{limit}",
            file=sys.stderr,
            disable=rank != 0,
            unit="layout-chain",
        )

    def show(self, bar) -> None:
        """One more chain on ``bar`` (None: no bar), with the estimate of the whole profile measured fully."""
        if bar is not None:
            bar.set_postfix_str(f"estimate {self.estimate():.0f} s in full", refresh=False)
            bar.update(1)

    def estimate(self) -> float:
        """Estimated wall seconds of this rank's chains all measured fully: those measured fully
        as they took, the others as `cost` prices them now."""
        return sum(self.full_s.get(j) or self.cost(j, False) for j in range(len(self.chains)))
