"""Research planners: ablations of `dcp` and reproductions, reached by name from `simulate`,
`plan` and the benchmarks (`plan.policies.RESEARCH`)."""
