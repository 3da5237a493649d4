"""Reuse a cached profile when it matches, profile in the same launch when it doesn't.

`load_or_profile` is what `DataCentricParallel.prepare` calls: every rank checks the cached
file; if any rank finds it missing, unreadable, of another version, measured for something
else (fingerprint: model structure and parameter count, dtype, device, world size, torch
version, method, search settings) or lacking a bucket the dataset needs, all ranks profile
together and rank 0 writes the new file. The reason is logged, never raised from deep
inside the planner.

The memory budget is not part of the match: a profile measured under a budget holds every
layout that fits it, measured, so it serves any budget at most as large — its entries are
re-judged against the new budget (model state + measured memory, as the profiler judges
them; `rebudget`). A larger budget than the cached one profiles again (layouts past the
cached budget were never measured).

Profiles are kept per world size: ``path`` holds the latest profile, and a copy of each
world size's profile sits beside it (``profile.world4.json``). A launch at another world size
reuses its own copy when it matches, and a profile of another world size found at ``path``
is kept under its own name before ``path`` is overwritten (a run resumed 4 -> 2 -> 4 ranks
profiles each world size once).

    profiler = Profiler(model, model.layers, text_inputs(model, device), spec=spec, engine=dc)
    sizes = representative_sizes(spec, dataset_lengths)   # the largest sample per cost class
    profile, _ = load_or_profile("profiles/llama.json", profiler, sizes)
    cost = ProfiledCost(profile, cluster)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from dcparallel.cost.schema import Profile, ProfileBucket
from dcparallel.profile.journal import Journal
from dcparallel.profile.profiler import Profiler, ProfileStats
from dcparallel.runtime import comm
from dcparallel.spec import Size

log = logging.getLogger(__name__)


def fingerprint_diff(cached: dict, current: dict) -> list[str]:
    """Human-readable differences, e.g. ``dtype: cached 'float32', now 'bfloat16'``."""
    out = []
    for k in sorted(set(cached) | set(current)):
        if cached.get(k) != current.get(k):
            out.append(f"{k}: cached {cached.get(k)!r}, now {current.get(k)!r}")
    return out


#: fingerprint keys of the memory budget: matched by `check_cached` as "at most the cached one"
BUDGET_KEYS = ("memory_bytes", "memory_limited")


def rebudget(prof: Profile, fingerprint: dict) -> Profile:
    """The cached profile as a profile under ``fingerprint``'s (smaller or equal) budget: an
    entry whose model state + memory exceeds it becomes infeasible ("over_budget")."""
    budget = float(fingerprint["memory_bytes"])
    d = prof.to_json()
    d["fingerprint"] = {**d["fingerprint"], **{k: fingerprint[k] for k in BUDGET_KEYS if k in fingerprint}}
    for e in d["entries"]:
        if (
            e.get("feasible")
            and e.get("memory_bytes") is not None
            and prof.model_state_bytes + float(e["memory_bytes"]) > budget
        ):
            e["feasible"], e["reason"] = False, "over_budget"
    return Profile.from_json(d)


def check_cached(path: str | Path, fingerprint: dict, sizes: Sequence[Size]) -> tuple[Profile | None, str]:
    """(the cached profile, "") if it can be reused, else (None, why not)."""
    p = Path(path)
    if not p.exists():
        return None, f"no cached profile at {p}"
    try:
        prof = Profile.load(p)
    except ValueError as exc:
        return None, f"cached profile unusable: {exc}"
    strip = lambda fp: {k: v for k, v in fp.items() if k not in BUDGET_KEYS}  # noqa: E731
    diff = fingerprint_diff(strip(prof.fingerprint), strip(fingerprint))
    cached_budget, budget = prof.fingerprint.get("memory_bytes"), fingerprint.get("memory_bytes")
    # None: no budget (nothing was infeasible for want of memory), larger than any number
    if cached_budget is not None and (budget is None or float(budget) > float(cached_budget)):
        diff.append(
            f"memory_bytes: cached {cached_budget!r}, now {budget!r} (a larger budget than the cached "
            f"profile's: layouts past it were never measured)"
        )
    if diff:
        return None, f"cached profile {p} was measured for something else ({'; '.join(diff)})"
    if budget is not None and (cached_budget is None or float(budget) < float(cached_budget)):
        prof = rebudget(prof, fingerprint)
    have = {b.key for b in prof.buckets}
    missing = [b.key for b in (ProfileBucket.of(prof.model, s) for s in sizes) if b.key not in have]
    if missing:
        return None, f"cached profile {p} lacks buckets {missing}"
    return prof, ""


def world_path(path: str | Path, world_size: int) -> Path:
    """The per-world-size copy of a profile path: ``run/profile.json`` -> ``run/profile.world2.json``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.world{int(world_size)}{p.suffix or '.json'}")


def _other_world(path: str | Path) -> bool:
    """True if ``path`` is missing or holds a profile of another world size (then this world
    size's own copy may be used; a same-world profile that does not match is re-measured)."""
    p = Path(path)
    if not p.exists():
        return True
    try:
        return Profile.load(p).world_size != comm.world_size()
    except ValueError:
        return False


def load_or_profile(path: str | Path, profiler: Profiler, sizes: Sequence[Size]) -> tuple[Profile, ProfileStats | None]:
    """The profile for ``profiler``'s model and these bucket sizes: the cached file at
    ``path`` (or its copy for this world size, `world_path`) if it matches (stats None), else
    a fresh profile written there. Call on every rank together."""
    fp = profiler.fingerprint()
    cached, why = check_cached(path, fp, sizes)
    if why and _other_world(path):
        mine = world_path(path, comm.world_size())
        if mine.exists():
            cached, why2 = check_cached(mine, fp, sizes)
            why = why2 and f"{why}; {why2}"
    # every rank must take the same branch (profiling is collective); a rank reading a large
    # file waits for the others on the control group
    reasons = comm.all_gather_object(why, comm.control_group())
    why = next((r for r in reasons if r), "")
    if not why:
        assert cached is not None
        log.info("reusing the cached profile %s", path)
        return cached, None
    log.warning("%s: profiling now", why)
    return profile_and_save(path, profiler, sizes)


def profile_and_save(path: str | Path, profiler: Profiler, sizes: Sequence[Size]) -> tuple[Profile, ProfileStats]:
    """Profiles on every rank together; rank 0 writes the profile to ``path``."""
    profile, stats = profiler.run(sizes, journal_path=path)
    budget = profiler.config.budget_s
    if comm.world_rank() == 0 and budget is not None:
        (log.warning if stats.seconds > budget else log.info)(
            "profiled in %.0f s (budget %.0f s): %d layout chains measured coarsely, %d not measured "
            "(priced from the measured ones)",
            stats.seconds,
            budget,
            stats.chains_coarse,
            stats.chains_skipped,
        )
    if comm.world_rank() == 0:
        p = Path(path)
        if p.exists():
            try:
                old = Profile.load(p)
            except ValueError:
                old = None
            if old is not None and old.world_size != profile.world_size and not world_path(p, old.world_size).exists():
                p.replace(world_path(p, old.world_size))  # another world size's profile: kept, not overwritten
        profile.save(p)
        profile.save(world_path(p, profile.world_size))
    comm.barrier(comm.control_group())  # the others wait for rank 0's writes
    Journal(path, comm.world_rank(), "").remove()  # saved whole: the chains saved as it went are done with
    return profile, stats
