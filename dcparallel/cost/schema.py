"""The profile's typed schema: `Profile`, `ProfileBucket`, `ProfileEntry` and their JSON form.

Profile JSON, schema ``dcparallel.profile`` version 2 (version 1, without the spread of
each entry, still loads: its spread counts as unknown)::

    {
      "schema": "dcparallel.profile", "version": 2,
      "fingerprint": {...},            # what the profile is valid for (model, dtype, device,
                                       # world size, torch version); compared by the profiler
      "model": {ModelSpec fields},     # the model as the planner sees it
      "world_size": 2, "gpus_per_node": 2,
      "model_state_bytes": 1.2e6,      # per rank: parameters, gradients, optimizer shard
      "grad_sync_s": 0.004,            # the once-per-step gradient all-reduce
      "buckets": [{"key": "t1024", "size": 1024 | [frames, height, width], "tokens": 1024}],
      "entries": [{"bucket": "t1024", "sp": 1, "mbs": 2,
                   "recompute": "none" | "attn" | "mlp" | "full",
                   "time_s": 0.12 | null,           # fwd + bwd of the whole model (extrapolated)
                   "memory_bytes": 3.4e8 | null,    # peak activation bytes per rank, model
                                                    # states excluded (extrapolated)
                   "feasible": true}],              # false: ran out of memory
      "unfit_buckets": ["t65536"],      # optional: buckets with no feasible layout at all
      "shard_size": 1,                  # optional (absent = 1): the parameter-shard block size
                                        # it was measured at (times include the block's
                                        # collectives, model_state_bytes the sharded states)
      "reference_s": 0.004,             # optional (absent = none): the median time of the
                                        # profiler's reference run; entries with a load_scale
                                        # were rescaled to it (`profile.drift`)
      "vision": {"patches": [...], "seconds": [...], "kept_bytes": [...], "trainable": true}
                                        # optional (absent = none): a vision-language model's
                                        # tower measured per patch bucket (`cost.vision.VisionTable`);
                                        # the model's "vision" holds its VisionTower fields
    }

Optional entry fields (absent = none): ``time_spread`` (the relative half-width of the 95%
interval of ``time_s``: the time is known to within time_s x (1 +- time_spread)),
``rounds`` (timed rounds) and ``rejected`` (outlier rounds dropped; `profile.robust`),
``ranks`` (the SP group that measured it),
``measured`` (``depths``, ``time_s``, ``memory_bytes``: the short stacks it was extrapolated
from; ``layer_s``: the time of one layer used, the median of per-round differences;
``reference_s``: the reference run's time while it was measured, ``load_scale``: the factor
its time_s was multiplied by, the profile's reference_s / this one; absent when not rescaled),
``ring`` (the ring degree of the Ulysses x ring split it was measured at, ``sp / ring`` the
Ulysses degree; absent: the size's `Topology.measured_split`), ``validation`` (``time_s``,
``memory_bytes`` measured at full depth, or ``error`` if that ran out of memory), ``reason``
("oom": a short stack ran out of memory; "over_budget": the extrapolation does not fit the
memory budget) and ``error`` (the out-of-memory message).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dcparallel.cost.vision import VisionTable
from dcparallel.spec import STATIC_MODES, ModelSpec, Size, VisionTower, check_size

#: noise warnings already logged by this process (`Profile.warn_if_noisy`)
_NOISE_WARNED: set[str] = set()

SCHEMA = "dcparallel.profile"
VERSION = 2
#: versions `Profile.from_json` reads (1: no ``time_spread``)
READABLE_VERSIONS = (1, 2)
#: a profile whose median entry is known less well than +-this (`ProfileEntry.time_spread`),
#: or whose worst entry less well than +-3x this, is too noisy to trust
NOISY_SPREAD = 0.10


@dataclass(frozen=True)
class ProfileBucket:
    """A representative sample size the profile measured, under its key (``t1024``, ``v16x256x256``)."""

    key: str
    size: Size
    tokens: int

    @staticmethod
    def of(spec: ModelSpec, size: Size) -> ProfileBucket:
        size = check_size(size)
        key = f"t{size}" if isinstance(size, int) else "v" + "x".join(map(str, size))
        return ProfileBucket(key, size, spec.tokens(size))

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "size": list(self.size) if isinstance(self.size, tuple) else self.size,
            "tokens": self.tokens,
        }

    @staticmethod
    def from_json(d: dict) -> ProfileBucket:
        size = tuple(d["size"]) if isinstance(d["size"], list) else d["size"]
        return ProfileBucket(str(d["key"]), check_size(size), int(d["tokens"]))


@dataclass
class ProfileEntry:
    """One measured layout of one bucket: SP degree, micro-batch size, recompute mode."""

    bucket: str
    sp: int
    mbs: int
    recompute: str
    time_s: float | None = None
    memory_bytes: float | None = None
    feasible: bool = True
    time_spread: float | None = None
    rounds: int | None = None
    rejected: int | None = None
    ranks: list[int] | None = None
    measured: dict | None = None
    validation: dict | None = None
    reason: str | None = None
    error: str | None = None
    #: the ring degree of the split it was measured at; None: the size's `Topology.measured_split`
    ring: int | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v is not None or k in ("time_s", "memory_bytes")}

    @staticmethod
    def from_json(d: dict, i: int, buckets: set[str]) -> ProfileEntry:
        """Entry ``i`` of a profile, validated (``buckets``: the profile's bucket keys)."""
        known = {f.name for f in fields(ProfileEntry)}
        e = ProfileEntry(**{k: v for k, v in d.items() if k in known})
        e.sp, e.mbs, e.feasible = int(e.sp), int(e.mbs), bool(e.feasible)
        if e.recompute not in STATIC_MODES or e.bucket not in buckets:
            raise ValueError(f"entry {i} has an unknown recompute mode or bucket: {d}")
        if e.sp < 1 or e.mbs < 1:
            raise ValueError(f"entry {i} has sp={e.sp}, mbs={e.mbs}; both must be >= 1")
        if e.ring is not None:
            e.ring = int(e.ring)
            if e.ring < 1 or e.sp % e.ring:
                raise ValueError(f"entry {i} has ring={e.ring} at sp={e.sp}; the ring degree must divide the SP degree")
        if e.feasible:
            for name in ("time_s", "memory_bytes"):
                v = getattr(e, name)
                if v is None:
                    raise ValueError(f"entry {i} ({e.bucket}, sp={e.sp}, mbs={e.mbs}) is feasible but has no {name}")
                _check_number(f"entry {i} ({e.bucket}, sp={e.sp}, mbs={e.mbs}) has {name}", v)
        if e.time_spread is not None:
            _check_number(f"entry {i} ({e.bucket}, sp={e.sp}, mbs={e.mbs}) has time_spread", e.time_spread)
        return e

    def time_range(self) -> tuple[float, float]:
        """(low, high) of the time: time_s x (1 -+ time_spread); the point when no spread is known."""
        t, r = float(self.time_s), float(self.time_spread or 0.0)
        return max(0.0, t * (1 - r)), t * (1 + r)


def _check_number(what: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{what} = {v!r}; times and memory must be finite and >= 0")


@dataclass
class Profile:
    """A measured profile: what `ProfiledCost` prices micro-batches from."""

    fingerprint: dict
    model: ModelSpec
    world_size: int
    gpus_per_node: int
    model_state_bytes: float
    grad_sync_s: float
    buckets: list[ProfileBucket]
    entries: list[ProfileEntry]
    unfit_buckets: list[str] = field(default_factory=list)
    #: the parameter-shard block size the profile was measured at (`ClusterSpec.shard_size`)
    shard_size: int = 1
    #: the reference run's median time (`profile.drift`): the machine's speed while profiling, and the speed
    #: every entry is priced at when rescaled (entries' ``measured["load_scale"]``); None: no reference run
    reference_s: float | None = None
    #: a vision-language model's tower measured per patch bucket (`profile.vision`); None: not measured
    vision: VisionTable | None = None

    def __post_init__(self) -> None:  # JSON-shaped buckets and entries are accepted too
        self.buckets = [b if isinstance(b, ProfileBucket) else ProfileBucket.from_json(b) for b in self.buckets]
        self.entries = [e if isinstance(e, ProfileEntry) else ProfileEntry(**e) for e in self.entries]

    def to_json(self) -> dict:
        model = {f.name: getattr(self.model, f.name) for f in fields(self.model)}
        if self.model.vision is not None:
            model["vision"] = dataclasses.asdict(self.model.vision)
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "model": model,
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "model_state_bytes": self.model_state_bytes,
            "grad_sync_s": self.grad_sync_s,
            "buckets": [b.to_json() for b in self.buckets],
            "entries": [e.to_json() for e in self.entries],
            "unfit_buckets": self.unfit_buckets,
            "shard_size": self.shard_size,
            **({"reference_s": self.reference_s} if self.reference_s is not None else {}),
            **({"vision": self.vision.to_json()} if self.vision is not None else {}),
        }

    def save(self, path: str | Path) -> None:
        """Writes the JSON atomically (a reader never sees half a file)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(p)

    @staticmethod
    def from_json(d: dict, source: str = "profile") -> Profile:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ValueError(
                f"{source} is not a dcparallel profile (schema {d.get('schema')!r}, "
                f"expected {SCHEMA!r}); re-run `dcparallel profile`"
            )
        if d.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"{source} has profile version {d.get('version')!r}; this dcparallel reads "
                f"versions {list(READABLE_VERSIONS)}: re-run `dcparallel profile` to regenerate it"
            )
        try:
            tower = d["model"].get("vision")
            model = ModelSpec(**{**d["model"], "vision": VisionTower(**tower) if tower is not None else None})
            buckets = [ProfileBucket.from_json(b) for b in d["buckets"]]
            keys = {b.key for b in buckets}
            entries = [ProfileEntry.from_json(e, i, keys) for i, e in enumerate(d["entries"])]
            measured = {e.bucket for e in entries}
            unfit = [str(k) for k in d.get("unfit_buckets", [])]
            missing = [k for k in sorted(keys) if k not in measured and k not in set(unfit)]
            if missing:
                raise ValueError(f"bucket(s) {missing} have no entries (and are not listed as unfit)")
            if not any(e.feasible for e in entries) and not unfit:
                raise ValueError("no entry is feasible and no bucket is listed as unfit")
            for name in ("model_state_bytes", "grad_sync_s"):
                _check_number(name, d[name])
            reference_s = d.get("reference_s")
            if reference_s is not None:
                _check_number("reference_s", reference_s)
            return Profile(
                fingerprint=dict(d.get("fingerprint", {})),
                model=model,
                world_size=int(d["world_size"]),
                gpus_per_node=int(d["gpus_per_node"]),
                model_state_bytes=float(d["model_state_bytes"]),
                grad_sync_s=float(d["grad_sync_s"]),
                buckets=buckets,
                entries=entries,
                unfit_buckets=unfit,
                shard_size=int(d.get("shard_size", 1)),
                reference_s=None if reference_s is None else float(reference_s),
                vision=VisionTable.from_json(d["vision"]) if d.get("vision") is not None else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source} is corrupt ({exc}); delete it and re-run `dcparallel profile`") from exc

    def spreads(self) -> list[float] | None:
        """Each feasible entry's `ProfileEntry.time_spread`; None when the profile holds none
        (version 1, or a profile built by hand)."""
        out = [e.time_spread for e in self.entries if e.feasible and e.time_spread is not None]
        return out or None

    def noise_warning(self, threshold: float = NOISY_SPREAD) -> str | None:
        """A sentence saying the profile is too noisy to trust (`NOISY_SPREAD`), or None."""
        sp = self.spreads()
        if sp is None:
            return None
        med, worst = sorted(sp)[len(sp) // 2], max(sp)
        if med <= threshold and worst <= 3 * threshold:
            return None
        bad = sum(x > threshold for x in sp)
        return (
            f"the profile is too noisy to trust: its layouts' times are known to within +-{100 * med:.0f}% "
            f"(median), +-{100 * worst:.0f}% (worst), {bad} of {len(sp)} beyond +-{100 * threshold:.0f}%; "
            f"predictions priced by it may be far off. Profile again on a quiet machine (no other jobs), "
            f"or with more rounds (ProfilerConfig max_repeats, min_time_s)"
        )

    def warn_if_noisy(self, log: Any) -> None:
        """Logs `noise_warning` once per process for the same sentence: the profiler that
        measured the profile and the cost model that prices with it would each say it."""
        noisy = self.noise_warning()
        if noisy and noisy not in _NOISE_WARNED:
            _NOISE_WARNED.add(noisy)
            log.warning(noisy)

    @staticmethod
    def load(path: str | Path) -> Profile:
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read profile {p}: {exc}; re-run `dcparallel profile`") from exc
        return Profile.from_json(d, source=str(p))
