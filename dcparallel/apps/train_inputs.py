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


def check_fits(
    spec, lengths, world_size: int, gpus_per_node: int, memory_bytes: int, skip_oversize: bool = False
) -> None:
    """Raises the planner's `NoLayoutFits` (the message `simulate` prints) up front, before
    any profiling, when a sample fits no layout by the analytic cost model: the profiler
    would otherwise try to run it and die on a raw allocator error. The analytic model
    estimates memory from calibrated constants, so this catches samples far beyond memory;
    the profile decides the rest. With ``skip_oversize`` the samples that fit no layout are
    left to the loader to skip."""
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.plan.context import PlanContext
    from dcparallel.spec import ClusterSpec, Workload

    cluster = ClusterSpec(
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        memory_bytes=int(memory_bytes),
        intra_bw=1e10,
        inter_bw=1e10,
        name="up-front check",
    )
    PlanContext(Workload(spec, tuple(lengths)), AnalyticCost(spec, cluster), cluster, skip_oversize=skip_oversize)


def check_config(cfg: Config, where: str) -> str:
    """`dcparallel train --check`: what can be checked in one process before torchrun starts
    the workers (the config is validated on loading): the lengths file, the dataset (every
    row read, tokenized and counted, bad samples named; the counts are cached for the run).
    A one-line summary, or a ValueError naming what is wrong."""
    d = cfg.data
    sizes = read_train_lengths(cfg)
    if d.path:
        from pathlib import Path

        if not Path(d.path).exists():
            raise ValueError(f"{where}: [data] path = {d.path!r} does not exist")
        sizes = _read_dataset_sizes(cfg)
    tokens = [s if isinstance(s, int) else s[0] * s[1] * s[2] for s in sizes]
    data = f"{d.path or 'synthetic'}: {len(sizes)} samples of {min(tokens)}-{max(tokens)} " + (
        "tokens" if cfg.model.family != "diffusers" else "latent positions"
    )
    model = cfg.model.pretrained or f"{cfg.model.family} {cfg.model.architecture or cfg.model.kind}".strip()
    return (
        f"{where}: config OK; model {model}; data {data}; policy {cfg.train.policy}, tokens_per_step "
        f"{cfg.train.tokens_per_step}, out_dir {cfg.train.out_dir}. Launch: torchrun --nproc-per-node N -m "
        f"dcparallel train --config {where}"
    )


def _read_dataset_sizes(cfg: Config) -> list:
    """Every sample's size from the real dataset, read as the run reads it."""
    d = cfg.data
    if cfg.model.family == "diffusers":
        from dcparallel.data.latents_data import latents_dataset

        return latents_dataset(d.path, latents_column=d.latents_column, text_column=d.text_column, skip_bad=d.skip_bad)[
            1
        ]
    if cfg.model.is_vlm():
        from dcparallel.apps.train_vlm import check_vlm_config, load_processor, read_vlm_data

        check_vlm_config(cfg)
        return read_vlm_data(cfg, load_processor(cfg.model.pretrained))[1]
    from transformers import AutoTokenizer

    from dcparallel.data.text_data import text_dataset

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.pretrained, local_files_only=True)
    return text_dataset(
        d.path,
        tokenizer,
        format=d.format or "text",
        field=d.field or None,
        max_tokens=d.max_tokens or None,
        truncate=d.truncate,
        skip_bad=d.skip_bad,
    )[1]
