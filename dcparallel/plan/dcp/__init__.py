"""`dcp`: the planner of the `dcp` policy, for thousands of GPUs (`portfolio.ScalePlanner`).

`portfolio` keeps the plan predicted fastest among its candidate planners: the class-level
planner on the SP degrees mixed, on the chain alone and on finer length classes; the
per-sample packing (`sample`); the per-sample planner `dcp-v1` (`plan/dcp_v1.py`) on small
clusters. The class level works on (bucket, count) pairs and classes of alike groups:
`tables` (per-run layout tables), `search` (layouts by a makespan target), `classes` (group
classes, allocation), `expand` and `refine` (sample ids, local searches); `config` holds the
thresholds.
"""
