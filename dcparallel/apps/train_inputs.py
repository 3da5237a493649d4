"""The up-front inputs of a `dcparallel train` run: the synthetic dataset's sizes ([data]
lengths) and the check, before any profiling, that every sample fits some layout."""

from __future__ import annotations

from dcparallel.apps.train_config import Config

#: the builtin latent shapes (frames, height, width) of a diffusers video run
BUILTIN_LATENTS = ((1, 8, 8), (1, 8, 12), (2, 8, 8), (3, 8, 12), (3, 12, 8), (5, 12, 16))


def read_train_lengths(cfg: Config) -> list:
    """The sizes of the synthetic dataset ([data] lengths); empty for a real dataset (path)."""
    from dcparallel.data.synthetic import builtin_lengths
    from dcparallel.scenarios import read_lengths

    video_model = cfg.model.family == "diffusers"
    if cfg.data.path:
        return []  # a real dataset's lengths are computed (and cached) when it is read
    if cfg.data.lengths == "builtin":
        if video_model:
            return [BUILTIN_LATENTS[(i * 7) % len(BUILTIN_LATENTS)] for i in range(cfg.data.num_samples)]
        return builtin_lengths(cfg.data.num_samples, cfg.train.seed)
    sizes = read_lengths(cfg.data.lengths)
    wrong = next((i for i, s in enumerate(sizes) if isinstance(s, tuple) != video_model), None)
    if wrong is not None:
        want = "a latent shape 'frames height width'" if video_model else "one token count"
        raise ValueError(f"{cfg.data.lengths}: sample {wrong} is {sizes[wrong]!r}; this model takes {want} a line")
    return [tuple(int(v) for v in x) if video_model else int(x) for x in sizes]


def check_fits(spec, lengths, world_size: int, gpus_per_node: int, memory_bytes: int,
               skip_oversize: bool = False) -> None:
    """Raises the planner's `NoLayoutFits` before any profiling when a sample fits no layout
    by the analytic cost model (calibrated constants: it catches samples far beyond memory,
    which the profiler would die on with a raw allocator error; the profile decides the rest);
    with ``skip_oversize`` the samples that fit no layout are left to the loader to skip."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.plan.context import PlanContext
    from dcparallel.spec import ClusterSpec, Workload

    cluster = ClusterSpec(world_size=world_size, gpus_per_node=gpus_per_node, memory_bytes=int(memory_bytes),
                          intra_bw=1e10, inter_bw=1e10, name="up-front check")
    PlanContext(Workload(spec, tuple(lengths)), AnalyticCost(spec, cluster), cluster, skip_oversize=skip_oversize)

