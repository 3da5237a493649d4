"""`dcp`'s tunables (`DcpConfig`): when each candidate planner of the portfolio runs, how far
the class-level search goes, how many class-level plans are expanded; the bounds of its caches.

One frozen instance is passed to the planner (`DEFAULT`: the values every plan of the scale
report is made with); the planner and its parts read it, never a module constant."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DcpConfig:
    # -- the per-sample planner (`per_sample.PerSamplePlanner`): cheap on small clusters and
    #    steps, it mixes SP degrees within a class, which the class level does not
    #: worlds of at most this many GPUs also run it
    per_sample_max_world: int = 64
    #: ... on steps of at most this many samples
    per_sample_max_samples: int = 1024

    # -- the class level over finer text classes: each class laid out for its largest sample
    #    wastes less where a step has few samples per GPU
    #: length ranges per bucket (2 ** (1 / finer_sub_bins) apart)
    finer_sub_bins: int = 4
    #: steps of at most this many samples per GPU ...
    finer_per_gpu: float = 8.0
    #: ... and at most this many samples ...
    finer_max_samples: int = 2048
    #: ... whose class-level plan is predicted more than this factor above the step's bound
    finer_gate: float = 1.01

    # -- the static layouts (`static.StaticLayout`: the tuned `bucket` and `packed` plans): a
    #    first-fit packing of the whole step per plan (`plan/binpack.py`: about 0.1 s at 27k
    #    text samples; a video step's bins are cut for memory sample by sample, over a second
    #    at 75k images)
    #: steps of at most this many samples are offered them (and they are tuned on those steps)
    static_max_samples: int = 4096

    # -- the per-sample packing (`sample.SamplePacker`): Python work per sample and target,
    #    so it runs only where the class level is loose
    #: steps of at most this many samples per GPU (and `pack_max_samples`) are packed sample by sample
    pack_per_gpu: float = 8.0
    pack_max_samples: int = 4096
    #: ... when the class-level plan is predicted more than this factor above its bound
    pack_gate: float = 1.05
    #: ... or this factor, with at most a sample per GPU (the class level, which times its samples
    #: by weights interpolated within a class, is least exact there) or a heavy tail (the longest
    #: micro-batch at least `pack_tail` of the bound: sub-groups fill a wide group after it)
    pack_gate_one: float = 1.03
    pack_tail: float = 0.5
    #: larger steps are packed in micro-batches of each class's preferred size, if at most this many:
    #: the packing's CPU time grows with them (a weak 4096-GPU pretrain-long step's 21k: about 0.4 s,
    #: for a plan 5% faster than the class level's; under 1% of that step, planned a step ahead)
    pack_max_items: int = 32768
    #: steps of at most this many samples per GPU are also packed one sample per micro-batch (with
    #: more, micro-batches of preferred size pack tighter on the scale report's steps)
    one_per_gpu: float = 2.0
    #: steps of at most this many samples per GPU are also packed in finer micro-batches: runs of
    #: each class's preferred size divided by each of `pack_splits` (with a few micro-batches per
    #: group, whole preferred ones leave groups finishing far apart)
    split_per_gpu: float = 16.0
    pack_splits: tuple[int, ...] = (2, 3)
    #: steps of at most this many samples per GPU whose classes each hold one size are also split
    #: one micro-batch per rank (`whole.WholeSplit`: where a rank has room for one micro-batch only)
    whole_per_gpu: float = 4.0
    #: steps of at most this many samples per GPU whose classes each hold one size have their packing's
    #: groups split again in pairs (`resplit.Resplit`: the slowest group's samples and a faster one's
    #: pooled and split anew), at most `resplit_rounds` times
    resplit_per_gpu: float = 16.0
    resplit_rounds: int = 512
    #: the smallest makespan target that packs is sought from the floor up in steps of this fraction of it ...
    gallop_first: float = 2.0**-9
    #: ... each step this many times the one before
    gallop_growth: int = 8
    #: below the first target that packs, the target is bisected until the bracket is this fraction of it ...
    continuous_gap: float = 2.0**-14
    #: ... in at most this many steps
    continuous_steps: int = 12

    # -- the class-level search
    #: a phase's search over its smallest allowed SP degree stops within this factor of its bound ...
    at_bound: float = 1.002
    #: ... or after this many wider minimums in a row that did not help
    stale_stop: int = 2
    #: the first search pass covers this many of the narrowest smallest degrees of every part at
    #: once (most parts stop there); a part that goes on searches the rest in a pass of its own
    first_degrees: int = 3
    #: makespan targets tried evenly spread first; then those between the last that does not fit
    #: and the first that does, this many at a time from the start, until the candidates are found
    search_coarse: int = 32
    #: a search's candidates: the first fitting target of its window, and these offsets after it
    candidate_offsets: tuple[int, ...] = (0, 1, 2, 4, 8)
    #: a step whose one-phase plan is predicted more than `cap_gate` x its bound is searched again
    #: with its micro-batches also capped at these fractions of the target (with a few samples of
    #: each of many shapes, capped micro-batches are shorter than T / 2 and share groups)
    cap_fractions: tuple[float, ...] = (1.0, 0.75)
    cap_gate: float = 1.01
    #: two-phase splits are searched where the one-phase plan is more than this factor above its bound
    two_phase_gate: float = 1.001

    #: floors (no plan is predicted below them) are lowered by this fraction, far above the
    #: rounding of the sums they bound
    floor_slack: float = 1e-9

    # -- expansion to sample ids
    #: how many of the best class-level candidates are expanded and refined per step ...
    expand_best: int = 3
    #: ... each only within this factor of the best one's prediction
    expand_within: float = 1.02
    #: refinement rounds per SP degree (`refine.refine`); each pairs up to `refine_pairs` of the
    #: degree's most loaded groups with its least loaded ones and moves or swaps one micro-batch in every pair
    refine_rounds: int = 16
    refine_pairs: int = 256
    #: ... and stops once the degree's most loaded group has not got lighter for this many rounds
    refine_stall: int = 3
    #: whether floors skip work they prove cannot change the plans (False: the full search, for
    #: the tests that show the skipping lossless)
    prune: bool = True

    # -- bounded per-planner caches, emptied when full: they bound memory only (a planner's plans
    #    do not depend on what it has cached)
    #: entries of each large cache (candidate rows per (class, count), group spans, class deals)
    row_cache_limit: int = 50_000
    #: `LayoutTable.least_gpu`'s tables (one per set of degrees a phase uses)
    least_gpu_cache_limit: int = 64
    #: placements of distinct group-size lists (steps often repeat them)
    tile_cache_limit: int = 64


DEFAULT = DcpConfig()
