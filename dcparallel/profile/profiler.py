"""`Profiler`: measures a real model on this device, layout by layout, from short stacks.

For each bucket (a representative sample size) and each candidate layout — SP degree (every
size the world allows, on the real SP groups: Ulysses; with ring, past the heads too and
every size above one at two splits, `Topology.profiled_splits`, each entry carrying its ring
degree, the two in one chain), micro-batch size (1, 2, 4, ... until memory runs out or
samples/s stops improving by ``min_gain``), recomputation (none / attn / mlp / full, on
every layer) — the profiler runs forward + backward of stacks of ``depth - 1`` and ``depth``
layers (the others pass the hidden state through) and extrapolates time and activation
memory linearly to the full depth L (`measure.extrapolate`; depth 2: t_L = t2 + (L - 2)(t2 -
t1)). Each timed round runs both depths back to back (slow drifts of a shared machine cancel
in the pair) and gives one full-depth estimate; rounds go on until their median is stable
(`profile.robust`). ``ProfilerConfig.reference`` puts every layout on one clock (`profile.drift`).

Concurrency: for SP degree k the world splits into its aligned groups of k ranks; group i
takes buckets i, i + world/k, ...; the groups measure at once, the degrees in turn (`group_buckets`).
All ranks of a group agree on every outcome (time = slowest rank, memory = largest rank,
infeasible if any rank ran out of memory) before deciding to double the micro-batch, and at
the end every rank gathers every group's entries, so every rank holds the same profile.
Every agreement and exchange runs on gloo control groups with a long timeout, never on a
training group (`profile.control`): a rank waiting for a slower group waits there.

Out of memory is an outcome, not an error: the layout is marked infeasible (larger
micro-batches of that mode are not tried) and profiling continues. A bucket with no
feasible layout at any SP degree is listed in the profile's ``unfit_buckets``.

Runs happen through the training engine (`runtime.engine.Engine.micro_batch`), so what is
timed is what training runs: the engine's SP groups, recompute wrappers and gradient hooks.

Shard blocks (an engine with shard_size s > 1): the same runs, FSDP2's collectives included;
the model states, memory meter and gradient sync of each case are in `profile.shards`.

An out-of-memory on one rank of an SP group stops the layout on all of them: the group
agrees after each run, and before each collective of an untimed run, whether every rank is
still running (`control.run_together`; its docstring names what it cannot cover). Any other
error in a layout's inputs or runs stops the profile on every rank of the group, with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence

import torch
from torch import nn

from dcparallel.cost.schema import Profile, ProfileBucket, ProfileEntry
from dcparallel.profile import shards
from dcparallel.profile.budget import COARSE, COARSE_MODES, SKIP, Budget, largest_mbs
from dcparallel.profile.config import (  # noqa: F401 (re-exported)
    ProfilerConfig,
    ProfileStats,
    group_buckets,
    representative_sizes,
)
from dcparallel.profile.control import ControlGroups, run_together
from dcparallel.profile.drift import ReferenceClock, median_reference, rescale
from dcparallel.profile.inputs import MakeInputs
from dcparallel.profile.journal import Journal
from dcparallel.profile.measure import (
    SavedTensorMeter,
    Timer,
    active_depth,
    cuda_run_memory,
    device_name,
    free_memory,
    grad_sync_seconds,
    group_entry,
    worst_cuda_memory,
)
from dcparallel.profile.rounds import timed_rounds
from dcparallel.runtime import comm
from dcparallel.runtime.engine import Engine
from dcparallel.spec import STATIC_MODES, ClusterSpec, Layout, ModelSpec, Recompute, Size

log = logging.getLogger(__name__)

#: bumped when the measuring method changes in a way that makes old profiles incomparable
METHOD = "depth-extrapolation/1"


class Profiler:
    """Measures ``model`` layout by layout.

    ``layers``: the model's repeated blocks (as given to `DataCentricParallel`); one spec
    layer is ``layers_per_unit`` consecutive blocks (2 for a spatial + temporal pair).
    ``make_inputs``: builds a rank's micro-batch (see `profile.inputs`). ``spec``: the
    planner's view of the model (its ``num_layers`` units must match ``layers``).
    ``engine``: the `runtime.engine.Engine` already wrapping the model, if any (else one is
    created, which wraps the model in place). Every rank of the launch constructs the
    profiler and calls `run` together."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[nn.Module],
        make_inputs: MakeInputs,
        *,
        spec: ModelSpec,
        config: ProfilerConfig | None = None,
        engine: Engine | None = None,
        cluster: ClusterSpec | None = None,
        layers_per_unit: int = 1,
    ):
        self.config = config or ProfilerConfig()
        self.round_config = self.config  # the timing of the layout being measured: one round past the budget
        self.layers = list(layers)
        if layers_per_unit < 1 or len(self.layers) != spec.num_layers * layers_per_unit:
            raise ValueError(
                f"the spec has {spec.num_layers} layers of {layers_per_unit} blocks but the "
                f"model gives {len(self.layers)} blocks; pass layers_per_unit so that "
                f"blocks = spec.num_layers x layers_per_unit"
            )
        self.config.check(spec.num_layers)
        self.model, self.make_inputs, self.spec = model, make_inputs, spec
        self.unit = layers_per_unit
        self.engine = engine or Engine(model, layers=self.layers, num_heads=spec.num_heads, cluster=cluster)
        self.shard_size = shards.shard_size(self.engine)  # > 1: measured with FSDP2 in blocks (profile/shards.py)
        self.world, self.rank = comm.world_size(), comm.world_rank()
        self.cluster = self.engine.groups.cluster
        allowed = list(self.engine.groups.topology.sizes)
        sizes = allowed if self.config.sp_sizes is None else sorted(set(self.config.sp_sizes))
        if any(k not in allowed for k in sizes):
            raise ValueError(
                f"SP degrees {sizes} are not all allowed at world {self.world} with "
                f"{spec.num_heads} heads; allowed: {allowed}"
            )
        self.sp_sizes = list(sizes)
        self.params = self.engine.params
        self.device = self.params[0].device
        self.dtype = shards.compute_dtype(self.engine)
        self.timer = Timer(self.device)
        self.memory_limit = self._budget()
        self.cuda_memory: dict | None = None  # the worst `launch.cuda_memory` of the memory runs
        self.clock: ReferenceClock | None = None  # set by `run` with ProfilerConfig.reference
        self.control: ControlGroups | None = None  # set by `run`: where the ranks agree (`profile.control`)

    # ------------------------------------------------------------------ what it is valid for

    def _budget(self) -> float | None:
        lim = self.config.memory_limit
        if lim is not None and lim <= 0:
            raise ValueError(f"memory_limit must be > 0 bytes; got {lim}")
        if self.device.type == "cuda":
            total = float(torch.cuda.get_device_properties(self.device).total_memory)
            return total if lim is None else min(float(lim), total)
        return None if lim is None else float(lim)

    def model_state_bytes(self) -> float:
        """Per rank, the engine's recipe (`shards.state_bytes`)."""
        return shards.state_bytes(self.engine, self.spec, self.device)

    def fingerprint(self) -> dict:
        """What a profile is valid for; a cached profile is reused only if this matches."""
        mem = self.memory_limit
        if mem is None:  # CPU without a limit: the planner's budget is the machine's memory
            mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        return {
            "model": type(self.model).__name__,
            "structure": comm.digest(repr(self.model)),
            "num_params": int(sum(p.numel() for p in self.model.parameters())),
            "num_layers": self.spec.num_layers,
            "layers_per_unit": self.unit,
            "dtype": str(self.dtype).replace("torch.", ""),
            # measured under the loop's autocast (`runtime.autocast`): another profile than without
            **({"autocast_params": self.spec.autocast_params} if self.spec.autocast_params else {}),
            "device": device_name(self.device),
            "threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "world_size": self.world,
            "gpus_per_node": self.cluster.gpus_per_node,
            "sp_sizes": self.sp_sizes,
            # a str: torch's TorchVersion would make the loader's planning process (pure
            # core: `sim.plan_worker`) import torch to unpickle a fresh profile
            "torch": str(torch.__version__),
            "memory_bytes": int(mem),
            "memory_limited": self.memory_limit is not None,
            "method": METHOD,
            "depth": self.config.depth,
            # what was searched and how long each layout was timed: a profile searched more
            # narrowly (fewer micro-batch sizes, other modes) or timed more briefly is another profile
            "search": {
                "modes": list(self.config.modes),
                "max_mbs": self.config.max_mbs,
                "max_tokens": self.config.max_tokens,
                "min_gain": self.config.min_gain,
            },
            "timing": {
                **{k: getattr(self.config, k) for k in ("warmup", "repeats", "min_time_s", "max_repeats")},
                **({"reference": True} if self.config.reference else {}),
                **({"rescale": False} if self.config.reference and not self.config.rescale else {}),
            },
            **({"shard_size": self.shard_size} if self.shard_size > 1 else {}),
            # with ring, the (Ulysses, ring) splits measured per size: a profile of other splits is another profile
            **(
                {
                    "splits": {
                        str(k): [list(s) for s in self.engine.groups.topology.profiled_splits(k)] for k in self.sp_sizes
                    }
                }
                if self.engine.groups.topology.ring
                else {}
            ),
        }

    # ------------------------------------------------------------------ one run

    def _run(self, inputs, meter: SavedTensorMeter | None = None) -> None:
        with self.engine.micro_batch(inputs.batch) as ctx:
            if meter is None:
                loss = inputs.loss(ctx)
            else:
                with meter:
                    loss = inputs.loss(ctx)
            ctx.backward(loss)

    def _memory_run(self, inputs, state_bytes: float) -> float:
        """Runs once (a warm-up) and returns the activation bytes of the run."""
        if self.device.type == "cuda":
            peak, seen = cuda_run_memory(self.device, lambda: self._run(inputs))
            self.cuda_memory = worst_cuda_memory(self.cuda_memory, seen)
            if self.memory_limit is not None and state_bytes + peak > self.memory_limit:
                raise torch.OutOfMemoryError(
                    f"peak {state_bytes + peak:,.0f} bytes is over the budget {self.memory_limit:,.0f}"
                )
            return peak
        meter = shards.meter(self.engine, state_bytes, self.memory_limit)
        self._run(inputs, meter)
        if meter.bytes <= 0:
            raise RuntimeError(
                "the forward saved no tensors for backward: the CPU memory estimate "
                "(saved-tensor accounting) cannot measure this model"
            )
        return float(meter.bytes)

    def _measure(
        self,
        size: Size,
        ranks: tuple[int, ...],
        mbs: int,
        mode: str,
        depths: Sequence[int],
        full_depth: int | None = None,
        ring: int | None = None,
    ) -> dict:
        """This rank's medians per depth (in units) of one layout, or its out-of-memory.

        The group's ranks build their inputs, then run each depth once for its memory (the
        first warm-up) and agree after each whether every rank fitted (`control.run_together`),
        so all of them run the same collectives and stop at the same point. ``full_depth``
        (validation) is tried after the short stacks: if only it runs out of memory the layout
        keeps its short-stack measurement and the validation is skipped."""
        group = self.control.of(ranks)
        if ring is None:  # the size's measured split: ring > 1 only past the heads
            ring = self.engine.groups.topology.measured_split(len(ranks))[1]
        layout = Layout(len(ranks), mbs, Recompute.static(mode, self.spec.num_layers), ring)  # planner layers
        box: dict = {}
        mem: dict[int, float] = {}
        took: dict[int, float] = {}  # seconds of each depth's first (memory) run
        failed = False  # free memory (a full collection: ~0.1 s) only after an out-of-memory
        try:
            out, depths = self._memory_depths(box, size, layout, ranks, list(depths), full_depth, mem, took)
            failed = not out["ok"] or "validation_error" in out
            if not out["ok"]:
                return out
            timed = timed_rounds(
                self._depth,
                lambda: self._run(box["inputs"]),
                depths,
                took,
                config=self.round_config,
                num_layers=self.spec.num_layers,
                timer=self.timer,
                group=group,
                ranks=ranks,
                clock=self.clock,
            )
            if isinstance(timed, str):
                failed = True
                return {"ok": False, "error": timed}
            return {**out, "memory": {d: mem[d] for d in depths}, **timed}
        finally:
            box.clear()
            self.engine.zero_grad()
            if failed:
                free_memory(self.device)

    def _memory_depths(
        self,
        box: dict,
        size: Size,
        layout: Layout,
        ranks: tuple[int, ...],
        depths: list[int],
        full_depth: int | None,
        mem: dict[int, float],
        took: dict[int, float],
    ) -> tuple[dict, list[int]]:
        """Builds the group's inputs (into ``box["inputs"]``) and runs each depth once for its
        memory, the group agreeing after each step whether every rank fitted; then ``full_depth``
        when given. Returns ({"ok": False, "error"} or {"ok": True} with a "validation_error"
        when only the full depth ran out of memory) and the depths measured."""
        group, state = self.control.of(ranks), self.model_state_bytes()
        err = run_together(
            lambda: box.update(inputs=self.make_inputs(size, layout, ranks, self.rank)), group, ranks, guarded=False
        )
        for d in depths:
            if err:
                break
            err = run_together(lambda d=d: self._memory_depth(box["inputs"], d, state, mem, took), group, ranks)
        if err:
            return {"ok": False, "error": err}, depths
        out: dict = {"ok": True}
        if full_depth is not None:
            err = run_together(lambda: self._memory_depth(box["inputs"], full_depth, state, mem, took), group, ranks)
            if err:
                out["validation_error"] = err
            else:
                depths = [*depths, full_depth]
        return out, depths

    def _memory_depth(self, inputs, depth: int, state: float, mem: dict[int, float], took: dict[int, float]) -> None:
        """One run of a ``depth``-layer stack: its activation bytes into ``mem``, seconds into ``took``."""
        with self._depth(depth):
            t0 = time.perf_counter()
            try:
                mem[depth] = self._memory_run(inputs, state)
            finally:
                self.engine.zero_grad()
            took[depth] = time.perf_counter() - t0

    def _depth(self, depth: int):
        """Only the first ``depth`` layers (units) run inside this block (`measure.active_depth`)."""
        return active_depth(self.layers, depth * self.unit, self.engine.adapter.skip_block)

    def reference_clock(self, size: Size) -> ReferenceClock | None:
        """The reference run (`profile.drift`): one sample of ``size`` alone on this rank, no
        recomputation, one layer; None (no layout is rescaled) when it does not fit every rank."""
        inputs = self.make_inputs(
            size, Layout(1, 1, Recompute.static("none", self.spec.num_layers)), (self.rank,), self.rank
        )

        def run() -> float:
            with active_depth(self.layers, self.unit, self.engine.adapter.skip_block):
                return self.timer.time(lambda: self._run(inputs))

        fits = True
        try:
            run()  # warm-up
        except torch.OutOfMemoryError:
            fits = False
        self.engine.zero_grad()
        if all(comm.all_gather_object(fits, comm.control_group())):
            return ReferenceClock(run)
        free_memory(self.device)
        log.warning("the reference run (one sample of %s) does not fit: no rescaling for load drift", size)
        return None

    def _rings(self, sp: int) -> list[int]:
        """The ring degrees a group of ``sp`` ranks is measured at (`Topology.profiled_splits`)."""
        return [r for _, r in self.engine.groups.topology.profiled_splits(sp)]

    def _chain(
        self,
        b: ProfileBucket,
        ranks: tuple[int, ...],
        mode: str,
        ring: int,
        local: list[ProfileEntry],
        budget: Budget,
        coarse: bool,
        full: bool,
    ) -> int:
        """Measures micro-batch sizes 1, 2, 4, ... of one bucket, SP group, recompute mode and
        split into ``local`` until one does not fit or stops paying (`ProfilerConfig.min_gain`);
        ``full``: the first is validated at full depth. Returns the slopes clamped."""
        cfg, group, sp = self.config, self.control.of(ranks), len(ranks)
        d2, L = cfg.depth, self.spec.num_layers
        d1, state, clamped = d2 - 1, self.model_state_bytes(), 0
        mbs, best = 1, 0.0
        while True:
            mine = self._measure(b.size, ranks, mbs, mode, [d1, d2], L if full and mbs == 1 else None, ring)
            res = comm.all_gather_object(mine, group)
            entry = ProfileEntry(b.key, sp, mbs, mode, ranks=list(ranks), ring=ring)
            clamped += group_entry(entry, res, d1, d2, L, state, self.memory_limit)
            local.append(entry)
            budget.seen(sp, self.spec.tokens(b.size), entry)
            if not entry.feasible:
                return clamped
            # samples/s (on the reference clock when rescaling: load drift cancels); a
            # drop within the layout's own spread is noise and does not end the chain
            tput = mbs / entry.time_s * (entry.measured.get("reference_s", 1.0) if cfg.rescale else 1.0)
            if mbs > 1 and tput * (1 + (entry.time_spread or 0.0)) < best * (1 + cfg.min_gain):
                return clamped
            best = max(best, tput)
            tokens = self.spec.tokens(b.size)
            if (
                2 * mbs > cfg.max_mbs
                or (cfg.max_tokens is not None and 2 * mbs * tokens > cfg.max_tokens)
                or coarse
                or not all(comm.all_gather_object(budget.fits((b.key, sp, mode), 2 * mbs, coarse), group))
            ):
                return clamped
            mbs *= 2

    # ------------------------------------------------------------------ the whole profile

    def run(self, sizes: Sequence[Size], journal_path: str | os.PathLike | None = None) -> tuple[Profile, ProfileStats]:
        """Profiles every bucket of ``sizes`` (one representative sample size each) on every
        rank together; returns the same `Profile` on every rank and this run's stats.
        ``journal_path``: the profile's path; each finished layout chain is saved beside it
        and a profile started again skips what was saved (`profile.journal`)."""
        t_start = time.perf_counter()
        cfg = self.config
        buckets, keys = self._buckets_of(sizes)
        fp = self.fingerprint()
        comm.check_equal(comm.digest((fp, keys, cfg.modes)), "profiler configuration", comm.control_group())
        self.control = ControlGroups(self.sp_sizes, len(buckets))
        plan = group_buckets(buckets, self.sp_sizes, self.world, self.rank)  # (sp, ranks, bucket), in order
        key = comm.digest((fp, keys, dataclasses.replace(cfg, progress=False, budget_s=None)))
        journal = Journal(journal_path, self.rank, key) if journal_path is not None else None
        done = comm.all_gather_object(set(journal.done) if journal else set(), self.control.control)
        chains = [
            ((b.key, sp, m), b.tokens, largest_mbs(b.tokens, cfg.max_mbs, cfg.max_tokens))
            for sp, _, b in plan
            for m in cfg.modes
        ]
        budget = Budget(cfg.budget_s, chains, full_runs=2.0 * (cfg.warmup + cfg.repeats))
        state = self.model_state_bytes()
        local, clamped = self._measure_plan(plan, buckets, journal, done, budget)

        entries = self._gather_entries(local, keys)
        # with rescaling, every layout on the profile's median machine speed
        reference_s = rescale(entries) if cfg.rescale else median_reference(entries)
        self.clock = None
        clamped = sum(comm.all_gather_object(clamped, self.control.control))
        unfit = self._unfit_buckets(buckets, entries)
        stats = ProfileStats(
            layouts_measured=len(entries),
            layouts_infeasible=sum(not e.feasible for e in entries),
            unfit_buckets=unfit,
            slopes_clamped=clamped,
            cuda_memory=self.cuda_memory,
            chains_coarse=sum(comm.all_gather_object(budget.coarse, self.control.control)),
            chains_skipped=sum(comm.all_gather_object(budget.skipped, self.control.control)),
        )
        stats.add_validation(entries)

        profile = Profile(
            fingerprint=fp,
            model=self.spec,
            world_size=self.world,
            gpus_per_node=self.cluster.gpus_per_node,
            model_state_bytes=state,
            grad_sync_s=grad_sync_seconds(self.engine.flat_grad, self.timer, shards.sync_group(self.engine)),
            buckets=buckets,
            entries=entries,
            unfit_buckets=unfit,
            shard_size=self.shard_size,
            reference_s=reference_s,
        )
        if self.rank == 0:
            profile.warn_if_noisy(log)
        stats.seconds = max(comm.all_gather_object(time.perf_counter() - t_start, self.control.control))
        return profile, stats

    def _buckets_of(self, sizes: Sequence[Size]) -> tuple[list[ProfileBucket], list]:
        """One bucket per size (a representative sample size each) and their keys; refused empty or repeated."""
        if not sizes:
            raise ValueError("no bucket sizes to profile; pass at least one sample size")
        buckets = [ProfileBucket.of(self.spec, s) for s in sizes]
        keys = [b.key for b in buckets]
        if len(set(keys)) != len(keys):
            raise ValueError(f"bucket sizes repeat: {keys}; pass each size once")
        return buckets, keys

    def _measure_plan(
        self, plan: list, buckets: list[ProfileBucket], journal: Journal | None, done: list[set], budget: Budget
    ) -> tuple[list[ProfileEntry], int]:
        """Measures every chain (bucket, SP group, recompute mode) of ``plan`` this rank is in,
        or takes it from the journal; returns this rank's entries and slopes clamped."""
        cfg = self.config
        validate = cfg.validation_set(buckets, self.sp_sizes)
        bar = budget.progress_bar(self.spec.name, self.rank) if cfg.progress else None
        local: list[ProfileEntry] = []
        clamped = 0
        if cfg.reference:
            self.clock = self.reference_clock(min(buckets, key=lambda b: b.tokens).size)
        for sp, ranks, b in plan:
            for mode in cfg.modes:
                full = (b.key, sp, mode) in validate and self.spec.num_layers > cfg.depth
                clamped += self._run_chain(b, sp, ranks, mode, full, local, journal, done, budget)
                budget.show(bar)
        if bar is not None:
            bar.close()
        return local, clamped

    def _run_chain(
        self,
        b: ProfileBucket,
        sp: int,
        ranks: tuple[int, ...],
        mode: str,
        full: bool,
        local: list[ProfileEntry],
        journal: Journal | None,
        done: list[set],
        budget: Budget,
    ) -> int:
        """One chain at each ring split of ``sp`` (into ``local``, and the journal), or the
        chain skipped: saved before by every rank of the group, or cut by the time budget.
        ``full``: the first split is validated at full depth. Returns the slopes clamped."""
        chain, n_before, t0, clamped = (b.key, sp, mode), len(local), budget.elapsed(), 0
        level = max(comm.all_gather_object(budget.level(chain), self.control.of(ranks)))  # the group agrees
        coarse = level >= COARSE
        self.round_config = (
            dataclasses.replace(self.config, repeats=1, max_repeats=1, min_time_s=0) if coarse else self.config
        )
        if all(chain in done[r] for r in ranks) or level == SKIP or (coarse and mode not in COARSE_MODES):
            local += (saved := journal.entries(chain) if journal and chain in done[self.rank] else [])
            budget.done(chain, SKIP if not all(chain in done[r] for r in ranks) else None, 0.0, saved)
            return 0
        for i, ring in enumerate(self._rings(sp)):  # the measured split first: the one validated
            if i and not all(comm.all_gather_object(budget.fits(chain, 1, coarse), self.control.of(ranks))):
                break  # a later split that would pass the budget is not started
            clamped += self._chain(b, ranks, mode, ring, local, budget, coarse, full and i == 0)
        if journal is not None:
            journal.record(chain, [e for e in local[n_before:] if e.ranks[0] == self.rank])
        budget.done(chain, level, budget.elapsed() - t0, local[n_before:])
        return clamped

    def _gather_entries(self, local: list[ProfileEntry], keys: list) -> list[ProfileEntry]:
        """Every group's entries on every rank (each group's first rank speaks for it), in bucket,
        degree, split, mode and micro-batch order."""
        gathered = comm.all_gather_object([e for e in local if e.ranks[0] == self.rank], self.control.control)
        order = {k: i for i, k in enumerate(keys)}
        return sorted(
            (e for part in gathered for e in part),
            key=lambda e: (order[e.bucket], e.sp, e.ring or 0, STATIC_MODES.index(e.recompute), e.mbs),
        )

    def _unfit_buckets(self, buckets: list[ProfileBucket], entries: list[ProfileEntry]) -> list:
        """Buckets measured at every degree (not cut by the budget) and infeasible at each, warned of."""
        feasible, measured = {e.bucket for e in entries if e.feasible}, {(e.bucket, e.sp) for e in entries}
        unfit = [b.key for b in buckets if b.key not in feasible and all((b.key, k) in measured for k in self.sp_sizes)]
        for k in unfit:
            log.warning(
                "bucket %s fits no layout (every SP degree, every recompute mode, one sample) within "
                "%s bytes: samples of this size cannot be trained on this device",
                k,
                self.memory_limit,
            )
        return unfit
