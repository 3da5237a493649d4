"""The research planners: reproductions of other systems' planners from their published
descriptions (`peers`: `megatron-dcp`, `hbp`; `flexsp`; `token_budget`: `token-budget`), and
the ablations of `dcp`'s per-sample planner (`dcp_v1`): policies that `dcparallel simulate`,
`dcparallel plan`, the benchmarks and the tests compare `dcp` with. Users train with `dcp`,
`bucket` and `packed` (`plan.policies.POLICIES`). `refill` holds what-ifs on `dcp`'s per-sample
packing (the small samples dealt again), measured by `benchmarks/refill_probe.py`.

One-way: these modules may import the rest of `plan/`; of the package only the registry that
names research policies (`plan.policies`) imports them (tests/unit/test_architecture.py).
"""
