"""`dcp`: the planner of the `dcp` policy, for thousands of GPUs (`portfolio.ScalePlanner`).

`portfolio` keeps the plan predicted fastest among its candidate planners, each with a named
gate: the class level on the SP degrees mixed, on the chain alone and on finer text length
classes; the per-sample packing (`sample`, `targets`); the per-sample planner `dcp-v1`
(`plan/dcp_v1.py`) on small clusters. The class level (`classlevel`) works on (bucket, count)
pairs and classes of alike groups, its parts sharing one `tables.LayoutTable`: `search`
(layouts by a makespan target, floors), `allocate` and `classes` (groups per degree, group
classes and their dealing), `expand` and `refine` (sample ids, local searches). `config`
holds the tunables (`DcpConfig`).
"""
