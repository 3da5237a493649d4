"""`dcp`'s tunable thresholds: when each candidate planner of the portfolio runs, how far the
class-level search goes, how many candidates are expanded, cache sizes."""

#: worlds and steps small enough to also run the per-sample planner (`ScalePlanner.fine`)
FINE_MAX_WORLD = 64
FINE_MAX_SAMPLES = 1024

#: text steps with at most this many samples per GPU (and FEW_MAX_SAMPLES) are also planned
#: over `SUB_BINS` classes per bucket (length ranges of 2 ** (1 / SUB_BINS))
FEW_PER_GPU = 8.0
FEW_MAX_SAMPLES = 2048
SUB_BINS = 4
#: ... when the class-level plan is predicted more than this factor above the step's bound
FINER_GATE = 1.01

#: steps with at most this many samples per GPU (and PACK_MAX_SAMPLES) whose class-level plan
#: is predicted more than PACK_GATE x the class-level bound are also planned sample by sample
#: (`sample`). The packing is Python work per sample and per target: about 0.2 s for 900
#: samples and 2.5 s for 7,800 on the machine of benchmarks/plan-cpu-time_cpu_2026-12-01.md
PACK_PER_GPU = 8.0
PACK_MAX_SAMPLES = 4096
PACK_GATE = 1.05
#: ... or more than this factor, for steps with at most one sample per GPU (there the class
#: level, which lays every sample out as its bucket's largest, is least exact; its plan's score
#: opens the gate too) and for steps whose longest micro-batch takes at least PACK_TAIL of the
#: bound (a heavy tail: the packing's sub-groups fill a long sample's wide group after it)
PACK_GATE_ONE = 1.03
PACK_TAIL = 0.5
#: larger steps whose class-level plan is predicted more than PACK_GATE x the class-level bound
#: (a heavy tail of long samples: `sample`) are packed in micro-batches of each bucket's
#: preferred size, when there are at most this many of them
PACK_MAX_ITEMS = 8192

#: the search over a phase's smallest allowed SP degree stops when its best plan is within
#: AT_BOUND of the phase's bound, or after STALE_STOP wider minimums in a row did not help
AT_BOUND = 1.002
STALE_STOP = 2

#: the search first covers this many of the narrowest smallest allowed degrees of every part
#: at once; most parts stop there (STALE_STOP), the others search the rest when they get there
FIRST_DEGREES = 3

#: the search over makespan targets first tries this many of them, evenly spread, then the
#: ones between the last that does not fit and the first that does
SEARCH_COARSE = 32

#: a step whose one-phase class-level plan is predicted more than CAP_GATE x its bound is
#: searched again with its micro-batches also capped at these fractions of the makespan target
#: (`search.fits`' `fracs`). At 1 each bucket takes its longest micro-batches that finish
#: within the target T; with a few samples of each of many shapes (a realistic video mix at a
#: strong budget) most of those are longer than T / 2 and need a group each, where capped
#: lower they are shorter and share groups, at some cost in GPU-seconds
CAP_FRACTIONS = (1.0, 0.75)
CAP_GATE = 1.01

#: a class-level candidate is expanded only within this factor of the best one's prediction
EXPAND_WITHIN = 1.02

#: bounded per-planner caches (candidate rows per (bucket, count)); emptied when full
ROW_CACHE_LIMIT = 50_000
