"""`ProfilerConfig` (how much the profiler measures), `ProfileStats` (what a run found) and the buckets to profile."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dcparallel.cost.schema import ProfileBucket, ProfileEntry
from dcparallel.spec import STATIC_MODES, ModelSpec, Size, bucket_key, check_size


@dataclass(kw_only=True)
class ProfilerConfig:
    """How much to measure. Times are medians; every depth of a layout is timed in the same
    interleaved rounds so that load drifting on a shared machine hits all depths alike."""

    depth: int = 2
    """measure stacks of ``depth - 1`` and ``depth`` layers (units); 2: one and two layers, t1 and t2"""
    warmup: int = 1
    """untimed runs per depth before timing (the first also measures memory)"""
    repeats: int = 5
    """timed runs per depth, at least; the median is kept"""
    min_time_s: float = 1.0
    """short layouts get more timed rounds, until a layout's rounds add up to about this"""
    max_repeats: int = 25
    """at most this many timed runs per depth"""
    rel_tol: float = 0.03
    """add timed rounds until the median's 95% interval is within +-this fraction of it
    (`profile.robust`), up to ``max_repeats``"""
    outlier_k: float = 3.5
    """a round more than this many scaled MADs from the median is an outlier and dropped"""
    reference: bool = False
    """time a fixed reference run (smallest bucket, one sample, SP 1, one layer) in every round
    (`profile.drift`): each entry keeps the reference time of its rounds and the profile their
    median (`Profile.reference_s`), the machine's speed to compare a later run against"""
    rescale: bool = True
    """with ``reference``: also rescale every layout's time to the profile's median reference
    time, for shared machines whose load drifts over the minutes a profile takes. The reference
    run is slowed by the work before it (after SP 2 rounds, or longer rounds), so on a machine
    whose load does not drift rescaling adds that bias instead of removing one (`profile.drift`)"""
    max_mbs: int = 64
    """micro-batch sizes doubled up to this (`bucket` uses at most 64 samples a micro-batch,
    `dcp` up to `plan.context.MAX_COPIES`, priced past the largest measured by the marginal
    cost of a sample between the last two)"""
    max_tokens: int | None = None
    """stop doubling once a micro-batch would hold more tokens than this (None: no cap)"""
    min_gain: float = 0.05
    """keep doubling while samples/s improves by at least this fraction"""
    memory_limit: float | None = None
    """bytes per rank for model states + activations; on CPU a fake allocator limit (a
    forward that passes it raises torch.OutOfMemoryError), on GPU a budget below the card's
    memory. None: the card's memory (GPU), unlimited (CPU)"""
    modes: tuple[str, ...] = STATIC_MODES
    """recompute modes to measure ("none", "attn", "mlp", "full")"""
    sp_sizes: tuple[int, ...] | None = None
    """SP degrees to measure; None = every size the world allows (`Topology.sizes`)"""
    validate: bool = False
    """also run a few layouts at full depth (smallest and largest bucket, recompute none and
    full, one sample) and report the extrapolation error"""
    progress: bool = False
    """a tqdm bar on stderr (rank 0)"""
    budget_s: float | None = None
    """wall-time budget in seconds (None: none), enforced (`profile.budget`): the large buckets'
    chains are measured coarsely (one micro-batch size, recompute none / full only, one timed
    round) when the rest would not fit otherwise, and no layout starts whose estimate would end past it"""

    def check(self, num_layers: int) -> None:
        """Refuses settings no profile can be measured with (ValueError naming the field)."""
        if not 2 <= self.depth <= num_layers:
            raise ValueError(
                f"depth {self.depth} must be between 2 and the model's {num_layers} "
                f"layers (stacks of depth-1 and depth layers are measured)"
            )
        for name, value, low in (
            ("repeats", self.repeats, 1),
            ("warmup", self.warmup, 1),
            ("max_mbs", self.max_mbs, 1),
            ("max_repeats", self.max_repeats, self.repeats),
        ):
            if value < low:
                raise ValueError(f"ProfilerConfig.{name} must be >= {low}; got {value}")
        if self.min_gain < 0:
            raise ValueError(f"ProfilerConfig.min_gain must be >= 0 (a fraction, e.g. 0.05); got {self.min_gain}")
        bad = [m for m in self.modes if m not in STATIC_MODES]
        if bad:
            raise ValueError(f"unknown recompute modes {bad}; use some of {list(STATIC_MODES)}")

    def validation_set(self, buckets: Sequence[ProfileBucket], sp_sizes: Sequence[int]) -> set[tuple[str, int, str]]:
        """(bucket, SP degree, mode) run at full depth too: smallest and largest bucket,
        recompute none and full (empty unless ``validate``)."""
        if not self.validate:
            return set()
        by_tokens = sorted(buckets, key=lambda b: b.tokens)
        keys = {by_tokens[0].key, by_tokens[-1].key}
        modes = [m for m in ("none", "full") if m in self.modes] or [self.modes[0]]
        return {(k, sp, m) for k in keys for sp in sp_sizes for m in modes}

    @staticmethod
    def quick(max_tokens: int | None = None, **kw) -> ProfilerConfig:
        """What `DataCentricParallel.prepare` measures by default: 3 timed rounds per layout (about
        0.2 s of timing; more, up to 12, until the median is known to +-5%), micro-batches
        doubled only up to ``max_tokens`` tokens (prepare passes the dataset's longest sample;
        the cost model extrapolates larger micro-batches by their marginal cost), within
        `DEFAULT_BUDGET_S` (`profile.budget`). `dcparallel profile` keeps the fuller defaults for validation runs."""
        return ProfilerConfig(
            **{
                "repeats": 3,
                "min_time_s": 0.2,
                "max_repeats": 12,
                "rel_tol": 0.05,
                "max_tokens": max_tokens,
                "budget_s": DEFAULT_BUDGET_S,
                **kw,
            }
        )


#: the wall-time budget of a default profile (`ProfilerConfig.quick`): five minutes, enforced
DEFAULT_BUDGET_S = 300.0


@dataclass
class ProfileStats:
    layouts_measured: int = 0
    layouts_infeasible: int = 0
    seconds: float = 0.0
    time_error: float | None = None
    memory_error: float | None = None
    validation: list[dict] = field(default_factory=list)
    unfit_buckets: list[str] = field(default_factory=list)
    slopes_clamped: int = 0
    #: layout chains measured coarsely, and not measured, for the budget (`profile.budget`; summed
    #: over ranks: a chain of an SP group of k ranks counts k times)
    chains_coarse: int = 0
    chains_skipped: int = 0
    #: CUDA only: the largest allocated and reserved peaks and the least free device memory
    #: of this rank's memory runs (`measure.worst_cuda_memory`)
    cuda_memory: dict | None = None

    def add_validation(self, entries: Sequence[ProfileEntry]) -> None:
        """The extrapolation error of every entry validated at full depth (worst in
        ``time_error`` / ``memory_error``), or the error that stopped its validation."""
        for e in entries:
            v = e.validation
            where = {"bucket": e.bucket, "sp": e.sp, "mbs": e.mbs, "recompute": e.recompute}
            if v and "error" in v:
                self.validation.append({**where, "error": v["error"]})
            elif v:
                te = abs(e.time_s - v["time_s"]) / v["time_s"]
                me = abs(e.memory_bytes - v["memory_bytes"]) / v["memory_bytes"]
                self.validation.append(
                    {
                        **where,
                        "time_error": te,
                        "memory_error": me,
                        "predicted_time_s": e.time_s,
                        "full_depth_time_s": v["time_s"],
                        "predicted_memory_bytes": e.memory_bytes,
                        "full_depth_memory_bytes": v["memory_bytes"],
                    }
                )
        checked = [v for v in self.validation if "error" not in v]
        if checked:
            self.time_error = max(v["time_error"] for v in checked)
            self.memory_error = max(v["memory_error"] for v in checked)


def representative_sizes(spec: ModelSpec, sizes: Sequence[Size], ratio: float = 2.0) -> list[Size]:
    """The sizes to profile for a dataset: its samples grouped into cost classes `ratio` apart
    (`spec.bucket_key`; text: token ranges x2 apart by default, coarser than the planner's
    x1.25 since `ProfiledCost` interpolates in tokens between buckets) and the largest sample
    of each class, so a layout measured for a bucket fits all of its samples. Sorted by tokens."""
    if ratio <= 1.0:
        raise ValueError(f"ratio must be > 1 (e.g. 2.0 for token ranges x2 apart); got {ratio}")
    best: dict[tuple[int, int], Size] = {}
    for s in sizes:
        s = check_size(s)
        k = bucket_key(spec, s, ratio)
        if k not in best or spec.tokens(s) > spec.tokens(best[k]):
            best[k] = s
    return sorted(best.values(), key=lambda s: (spec.tokens(s), str(s)))


def group_buckets(
    buckets: Sequence[ProfileBucket], sp_sizes: Sequence[int], world: int, rank: int
) -> list[tuple[int, tuple[int, ...], ProfileBucket]]:
    """(SP degree, the group's ranks, bucket) that ``rank`` measures, in the order measured: for
    each degree k the world splits into aligned groups of k ranks and group i takes buckets
    i, i + world/k, ...; the degrees take turns, one bucket each (the first bucket of every
    degree, then the second, ...), so that a drift of the machine's speed over the minutes of
    a profile falls on every degree alike rather than on the policies that use one degree more
    than the others. Every rank orders its items by the same key (position in the degree's
    list, degree), so the ranks of a group reach the group's items in the same order."""
    keyed = []
    for j, sp in enumerate(sp_sizes):
        start = rank // sp * sp
        ranks = tuple(range(start, start + sp))
        keyed += [((i, j), (sp, ranks, b)) for i, b in enumerate(buckets[start // sp :: world // sp])]
    return [item for _, item in sorted(keyed, key=lambda x: x[0])]
