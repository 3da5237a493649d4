"""`dcp`: the planner of the `dcp` policy, for thousands of GPUs (`portfolio.DcpPlanner`).

`portfolio` keeps the plan predicted fastest among its candidate planners, each with one
interface (`candidate.Candidate`: a name, a gate, a proposal) and its gate reading facts the
planner derives (`candidate.StepFacts`): the class level on the SP degrees mixed (candidate
0), on the chain alone and on finer text length classes; the per-sample planner
(`per_sample`) on small clusters; the per-sample packing (`sample`, `targets`); the static
layouts (`static`). The class level (`classlevel.ClassLevelPlanner`) works on (class, count)
pairs and classes of alike groups; it holds a `tables.LayoutTable`, which its parts take:
`search` (layouts by a makespan target, floors), `allocate` and `classes` (groups per degree,
group classes and their dealing), `expand` and `refine` (sample ids, local searches).
`config` holds the tunables (`DcpConfig`).

A *class* here (a planning class; `pclass` in names) is always a class of alike samples
that plans are made for: the context's bucket (`PlanContext.bucket_of`) or, over finer
text classes, a length range of one (`tables.planning_classes`); groups gather in group
classes (`classes.GroupClass`), micro-batches in item classes (`classes.ItemClass`).
Bucket means only the context's buckets (the data's shape buckets, which the `bucket`
policy plans by) and the gradient sync's (`SamplePacker.sync_buckets`).
"""
