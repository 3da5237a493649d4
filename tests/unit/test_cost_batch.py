"""Pricing many micro-batches at once (`CostModel.terms_grid`, `cost.batch`) equals pricing
them one at a time, exactly (`==`, not approximately): a last-bit difference can flip a
planner's tie and change a plan, so the planners' vectorised pricing must be bit for bit the
scalar one. Checked on the analytic cost (text and video models, grouped-query and latent
attention heads, nodes spanned, shard blocks) and on profiled costs, for every field of the
terms, every recompute mode's choice, and the planning context's `fits_grid` / `mb_costs`."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import fields

import numpy as np
import pytest

from dcparallel.cost import batch
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.batch import Batches, TermsArray, exact_pow
from dcparallel.cost.forward import ForwardOnlyCost
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.plan.context import PlanContext
from dcparallel.plan.types import MicroBatch
from dcparallel.spec import LLAMA_7B, STDIT_1B, ClusterSpec, Recompute, VisionSize, Workload, h200_cluster

from ._models import TINY_DIT, TINY_LM, VIDEO_SHAPES, cluster
from .test_vision_cost import VLM

GiB = 2**30
MODES = ("none", "attn", "mlp", "full", "fit", "pac")
SPS = (1, 2, 4, 8, 16, 32)

GQA_MLA = dataclasses.replace(LLAMA_7B, name="gqa-mla", num_kv_heads=8, head_dim=192, v_head_dim=128)
VIDEO_FULL = dataclasses.replace(STDIT_1B, name="stdit-full", attention="full", attn_per_layer=1)


def _text_sizes(rng: random.Random, n: int, top: int) -> list[int]:
    return [int(rng.paretovariate(0.8) * 512) % top + 16 for _ in range(n)]


def _video_sizes(rng: random.Random, n: int) -> list[tuple[int, int, int]]:
    shapes = [(f, h, w) for f in (1, 16, 51, 102, 204) for h, w in ((144, 256), (240, 426), (480, 853), (720, 1280))]
    return [rng.choice(shapes) for _ in range(n)]


def _batches(rng: random.Random, sizes: list, n: int = 150) -> list[tuple]:
    """`n` micro-batches of 1 to 64 samples drawn from `sizes`, mixed and of copies, and one empty."""
    out = [()]
    for _ in range(n):
        n = rng.choice((1, 1, 2, 3, 5, 8, 16, 31, 64))
        out.append(tuple(rng.choice(sizes) for _ in range(n)) if rng.random() < 0.6 else (rng.choice(sizes),) * n)
    return out


def assert_grid_equals_scalar(cost, batches: list[tuple], sps, budget: float) -> None:
    grid = cost.terms_grid(Batches.of(cost.model, batches), sps)
    assert grid.shape == (len(batches), len(sps))
    best = grid.cheapest_recompute(budget)
    for i, b in enumerate(batches):
        for j, sp in enumerate(sps):
            one = cost.terms(b, sp)
            for f in fields(TermsArray):
                want, got = getattr(one, f.name), getattr(grid, f.name)
                assert (want == got) if f.name == "num_layers" else (want == got[i, j]), (f.name, b[:3], sp)
            r = one.cheapest_recompute(budget)
            assert (r.attn, r.mlp) == (best[0][i, j], best[1][i, j]) if r else best[0][i, j] == best[1][i, j] == -1
            for rc in (Recompute(0, 0), Recompute(1, 0), Recompute(3, 7), Recompute(99, 99)):
                assert one.time(rc) == grid.time(rc.attn, rc.mlp)[i, j]
                assert one.memory(rc) == grid.memory(rc.attn, rc.mlp)[i, j]


ANALYTIC = [
    (LLAMA_7B, h200_cluster(1024), "text", 131072),
    (GQA_MLA, h200_cluster(64), "text", 65536),
    (LLAMA_7B, h200_cluster(64, memory_bytes=40 * GiB, shard_size=8), "text", 65536),
    (TINY_LM, cluster(16), "text", 40_000),
    (STDIT_1B, h200_cluster(256), "video", 0),
    (VIDEO_FULL, h200_cluster(32, memory_bytes=24 * GiB), "video", 0),
    (TINY_DIT, cluster(16), "tiny-video", 0),
    # ring: every micro-batch at its own best (Ulysses, ring) split, on NVLink and PCIe-class nodes
    (GQA_MLA, dataclasses.replace(h200_cluster(64), ring=True), "text", 262144),
    (
        dataclasses.replace(LLAMA_7B, name="llama-24h", num_heads=24, hidden=3072),
        dataclasses.replace(h200_cluster(32, 32), ring=True, intra_bw=25e9, intra_latency=20e-6),
        "text",
        131072,
    ),
]


@pytest.mark.parametrize("model,cl,kind,top", ANALYTIC, ids=lambda v: getattr(v, "name", None))
def test_analytic_grid_equals_scalar_terms(model, cl, kind, top):
    rng = random.Random(7)
    sizes = (
        _text_sizes(rng, 400, top)
        if kind == "text"
        else _video_sizes(rng, 400)
        if kind == "video"
        else list(VIDEO_SHAPES)
    )
    cost = AnalyticCost(model, cl)
    # every recompute outcome occurs: none, partial, full and nothing fitting
    assert_grid_equals_scalar(cost, _batches(rng, sizes), SPS, float(cl.memory_bytes))


def _random_profile(seed: int, unfit: bool) -> tuple[Profile, ClusterSpec]:
    """A profile of TINY_LM with irregular times and memory (every interpolation and
    extrapolation rule is exercised), optionally with settings measured not to fit."""
    rng = random.Random(seed)
    buckets = [{"key": f"t{t}", "size": t, "tokens": t} for t in (64, 256, 1024, 4096)]
    entries = []
    for b in buckets:
        for sp in (1, 2, 4):
            for mbs in (1, 2, 4, 8):
                for mode, tf, mf in (("none", 1.0, 1.0), ("attn", 1.2, 0.7), ("mlp", 1.1, 0.6), ("full", 1.35, 0.2)):
                    work = b["tokens"] * mbs / sp
                    fits = not (unfit and mode == "none" and b["tokens"] * mbs >= 8192 and sp == 1)
                    t = (2e-4 + 3e-7 * work * rng.uniform(0.9, 1.1)) * tf
                    m = (5e5 + 900.0 * work * rng.uniform(0.95, 1.05)) * mf
                    entries.append(
                        {
                            "bucket": b["key"],
                            "sp": sp,
                            "mbs": mbs,
                            "recompute": mode,
                            "time_s": t if fits else None,
                            "memory_bytes": m if fits else None,
                            "feasible": fits,
                        }
                    )
    prof = Profile(
        fingerprint={"world_size": 4},
        model=TINY_LM,
        world_size=4,
        gpus_per_node=4,
        model_state_bytes=2e6,
        grad_sync_s=0.003,
        buckets=buckets,
        entries=entries,
    )
    return Profile.from_json(prof.to_json()), ClusterSpec(world_size=4, gpus_per_node=4, memory_bytes=16 * 2**20)


@pytest.mark.parametrize("seed,unfit", [(0, False), (1, True), (2, True)])
def test_profiled_grid_equals_scalar_terms(seed, unfit):
    prof, cl = _random_profile(seed, unfit)
    rng = random.Random(seed)
    sizes = [rng.randrange(16, 6000) for _ in range(60)] + [64, 256, 1024, 4096]
    for time_at in ("value", "low", "high"):
        cost = ProfiledCost(prof, cl, time_at=time_at)
        assert_grid_equals_scalar(cost, _batches(rng, sizes, 60)[1:], (1, 2, 4), float(cl.memory_bytes))


def _profiled(model, cl):
    prof, cl = _random_profile(4, True)
    return ProfiledCost(prof, cl), cl


CONTEXTS = [
    (LLAMA_7B, h200_cluster(1024), "text", 131072),
    (STDIT_1B, h200_cluster(256), "video", 0),
    (TINY_LM, cluster(16), "text", 40_000),
    (TINY_LM, "profiled", "text", 6000),
]


@pytest.mark.parametrize("model,cl,kind,top", CONTEXTS, ids=lambda v: getattr(v, "name", None))
def test_fits_grid_and_mb_costs_equal_layout_for(model, cl, kind, top):
    """What the planners read: per mode, the time and layout of every micro-batch at every
    degree (`fits_grid` against `layout_for`), and the simulator's time and memory of a
    micro-batch at its layout (`mb_costs` against `mb_time` / `mb_memory`)."""
    rng = random.Random(3)
    sizes = _text_sizes(rng, 600, top) if kind == "text" else _video_sizes(rng, 600)
    cost, cl = _profiled(model, cl) if cl == "profiled" else (AnalyticCost(model, cl), cl)
    ctx = PlanContext(Workload(model, tuple(sizes)), cost, cl, skip_oversize=True)
    ids = [[rng.choice(ctx.usable_ids) for _ in range(rng.choice((1, 2, 4, 9, 33)))] for _ in range(120)]
    mbs = []
    for mode in MODES:
        grid = ctx.fits_grid(ids, ctx.sp_sizes, mode)
        for i, mb in enumerate(ids):
            for j, k in enumerate(ctx.sp_sizes):
                fit = ctx.layout_for(tuple(ctx.sizes[s] for s in mb), k, mode)
                if fit is None:
                    assert grid.time[i, j] == np.inf and grid.attn[i, j] == grid.mlp[i, j] == -1
                    continue
                assert fit.time == grid.time[i, j], (mode, i, k)
                assert fit.layout.recompute == Recompute(int(grid.attn[i, j]), int(grid.mlp[i, j]))
                mbs.append(MicroBatch(tuple(mb), fit.layout))
    assert len({mb.layout.recompute for mb in mbs}) > 3  # several recompute settings met
    times, memory = ctx.mb_costs(mbs)
    assert times == [ctx.mb_time(mb.sample_ids, mb.layout) for mb in mbs]
    assert memory == [ctx.mb_memory(mb.sample_ids, mb.layout) for mb in mbs]
    assert ctx.mb_costs(mbs, memory=False) == (times, None)
    rng.shuffle(mbs)  # the degrees interleaved: each degree's micro-batches picked from the arrays
    assert ctx.mb_costs(mbs[:200])[0] == [ctx.mb_time(mb.sample_ids, mb.layout) for mb in mbs[:200]]


@pytest.mark.parametrize("kind", ["text", "video", "vlm"])
def test_a_subset_of_batches_is_its_micro_batches_own(kind):
    """`Batches.subset`: the picked micro-batches with their own samples, so their token,
    pair and vision sums (and maxima) are those of the whole, element for element."""
    rng = random.Random(7)
    model = {"text": TINY_LM, "video": STDIT_1B, "vlm": VLM}[kind]
    sizes = (
        _text_sizes(rng, 300, 6000)
        if kind == "text"
        else _video_sizes(rng, 300)
        if kind == "video"
        else [VisionSize(t, (256, 1024)[: 1 + t % 2]) for t in (500, 3000, 9000)]
    )
    whole = Batches.of(model, _batches(rng, sizes)[1:])
    js = np.flatnonzero(np.array([rng.random() < 0.4 for _ in range(len(whole))]))
    part = whole.subset(js)
    assert part.lengths.tolist() == whole.lengths[js].tolist() and len(part.tokens) == part.lengths.sum()
    assert part.token_sums().tolist() == whole.token_sums()[js].tolist()
    assert part.pair_sums().tolist() == whole.pair_sums()[js].tolist()
    assert (whole.vision is not None) is (kind == "vlm")
    if kind == "vlm":
        assert [v.tolist() for v in part.vision_sums()] == [v[js].tolist() for v in whole.vision_sums()]
    assert whole.subset(np.arange(len(whole))) is whole


COPIES = [
    *CONTEXTS,
    (TINY_DIT, cluster(16), "tiny-video", 0),
    (VLM, h200_cluster(64), "vlm", 0),
    (TINY_LM, "forward", "text", 6000),
]


@pytest.mark.parametrize("model,cl,kind,top", COPIES, ids=lambda v: getattr(v, "name", None))
def test_copies_times_equal_copies_layout(model, cl, kind, top):
    """The `dcp` tables' micro-batch times of m copies of one size, priced at once
    (`PlanContext.copies_times`, `terms_copies_grid`), against `copies_layout` one at a time:
    equal floats, inf exactly where m copies do not fit, for every mode and degree (analytic
    text, video and vision-language, profiled, forward-only over a profile)."""
    rng = random.Random(5)
    if kind == "vlm":
        sizes = [
            VisionSize(t, tuple(rng.choice((256, 1024, 4096)) for _ in range(n)))
            for t, n in ((500, 1), (3000, 1), (9000, 2), (20000, 3))
        ] + [700]
    else:
        sizes = (
            _text_sizes(rng, 30, top)
            if kind == "text"
            else _video_sizes(rng, 30)
            if kind == "video"
            else list(VIDEO_SHAPES)
        )
    if cl in ("profiled", "forward"):
        cost, cl2 = _profiled(model, cl)
        cost, cl = (ForwardOnlyCost(cost) if cl == "forward" else cost), cl2
    else:
        cost = AnalyticCost(model, cl)
    ctx = PlanContext(Workload(model, tuple(sizes)), cost, cl, skip_oversize=True)
    unfit = 0
    some = sorted({ctx.sizes[i] for i in ctx.usable_ids}, key=str)[:8]
    tops = [64, 1, *(rng.randint(2, 64) for _ in some[2:])][: len(some)]
    for mode in MODES:
        for k in ctx.sp_sizes:
            rows = ctx.copies_times(some, tops, k, mode)  # all sizes at once, as the tables price them
            assert [len(r) for r in rows] == tops
            for size, top, got in zip(some, tops, rows):
                for m in range(1, top + 1):
                    fit = ctx.copies_layout(size, m, k, mode)
                    assert got[m - 1] == (np.inf if fit is None else fit.time), (mode, size, k, m)
                    unfit += fit is None
    assert unfit > 0  # some counts do not fit: the inf path is compared too


def test_exact_pow_is_pythons_pow_on_either_path(monkeypatch):
    """`exact_pow` equals Python's ``**`` whether numpy's `float_power` is used (its loop calls
    the C library's `pow`, on CPUs with AVX-512 too) or each element is raised in Python;
    numpy's own ``x ** 2`` (a square) and, with AVX-512, its `power` are not always."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.random(20_000) * 10.0**e for e in (-8, -3, 0, 4)])
    assert batch._POW_IS_LIBM  # numpy's float_power loop is the C library's pow (numpy 2.x)
    for fast in (True, False):
        monkeypatch.setattr(batch, "_POW_IS_LIBM", fast)
        for p in (2.0, 4.0, 0.5, 0.25, 1 / 2.4):
            assert exact_pow(x, p).tolist() == [v**p for v in x.tolist()], (fast, p)


def test_batches_of_sizes_match_the_model():
    b = Batches.of(TINY_DIT, [[(17, 64, 64)] * 3, [], [(1, 128, 128), (34, 128, 128)]])
    assert b.lengths.tolist() == [3, 0, 2]
    assert b.token_sums().tolist() == [
        3 * TINY_DIT.tokens((17, 64, 64)),
        0,
        TINY_DIT.tokens((1, 128, 128)) + TINY_DIT.tokens((34, 128, 128)),
    ]
    assert b.token_runs() == [
        [TINY_DIT.tokens((17, 64, 64))] * 3,
        [],
        [TINY_DIT.tokens((1, 128, 128)), TINY_DIT.tokens((34, 128, 128))],
    ]
    assert b.pair_sums()[0] == 0.0 + TINY_DIT.attention_pairs((17, 64, 64)) * 3
