"""The paper-scale scenarios (reduced epochs so the suite stays fast): every policy is
lossless, and dcp-inter-pac is never slower than the tuned bucket baseline."""

import numpy as np
import pytest

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.scenarios import (
    ALL_DISTRIBUTIONS,
    DISTRIBUTIONS,
    MIXES,
    SCENARIOS,
    distinct_shapes,
    long_token_share,
    read_lengths,
    sample_sizes,
)
from dcparallel.sim.run import run_policies, summary
from dcparallel.spec import Workload


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_dcp_inter_pac_never_slower_than_bucket(scenario, distribution):
    sc = SCENARIOS[scenario]
    cl = sc.cluster(32, 8)
    sizes = sample_sizes(scenario, distribution, num_samples=600 if scenario == "text" else 400)
    w = Workload(sc.model, tuple(sizes))
    tps = sum(w.tokens) // 8  # eight steps
    _, steps, runs, bound = run_policies(
        w, AnalyticCost(sc.model, cl), cl, ["bucket", "dcp-inter-pac"], tokens_per_step=tps
    )
    s = summary(w, runs, bound)
    for v in s.values():
        assert v["samples_planned"] == len(sizes) and v["samples_dropped"] == 0 and v["samples_repeated"] == 0
        assert v["memory_violations"] == 0 and 0 < v["lower_bound_efficiency"] <= 1
    assert runs["dcp-inter-pac"].sim.total_time <= runs["bucket"].sim.total_time


def test_distributions_are_ordered_by_long_share():
    for scenario in SCENARIOS:
        m = SCENARIOS[scenario].model
        shares = [long_token_share(m, sample_sizes(scenario, d, num_samples=3000)) for d in ("short", "long")]
        assert shares[0] < shares[1]
    assert sample_sizes("text", "short", num_samples=50) == sample_sizes("text", "short", num_samples=50)


def test_lengths_files(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text("# tokens\n100\n2048\n\n7\n")
    assert read_lengths(p) == [100, 2048, 7]
    p.write_text("51 240 426\n1 720 1280\n")
    assert read_lengths(p) == [(51, 240, 426), (1, 720, 1280)]
    np.save(tmp_path / "a.npy", np.array([[17, 100, 200], [1, 64, 64]]))
    assert read_lengths(tmp_path / "a.npy") == [(17, 100, 200), (1, 64, 64)]
    for text, msg in [
        ("1 2\n", "`tokens` or `frames height width`"),
        ("abc\n", "expected integers"),
        ("0\n", "positive integer"),
        ("", "holds no samples"),
        ("5\n1 64 64\n", "mixes"),
    ]:
        p.write_text(text)
        with pytest.raises(ValueError, match=msg):
            read_lengths(p)
    with pytest.raises(ValueError, match="does not exist"):
        read_lengths(tmp_path / "missing.txt")


# -- the realistic mixes ---------------------------------------------------------------


def test_mixes_are_deterministic_and_seeded():
    for name, mix in MIXES.items():
        a = sample_sizes(mix.kind, name, num_samples=2000)
        assert a == sample_sizes(mix.kind, name, num_samples=2000), name
        assert a != sample_sizes(mix.kind, name, num_samples=2000, seed=1), name
        # a larger epoch extends the same sequence
        tps = SCENARIOS[mix.kind].tokens_per_step
        short = sample_sizes(mix.kind, name, epoch_tokens=2 * tps)
        assert sample_sizes(mix.kind, name, epoch_tokens=3 * tps)[: len(short)] == short, name


@pytest.mark.parametrize("name,num_shapes", [("video-mix", 64), ("video-wide", 200)])
def test_video_mixes_have_their_shapes(name, num_shapes):
    mix = MIXES[name]
    model = SCENARIOS["video"].model
    sizes = sample_sizes("video", name)  # the default epoch
    assert len(mix.shapes()) == num_shapes
    # every shape the mix can draw is drawn, and each is its own class for the planner
    assert set(sizes) == set(mix.shapes())
    assert distinct_shapes(model, sizes) == num_shapes
    images = sum(s[0] == 1 for s in sizes) / len(sizes)
    assert 0.37 < images < 0.43
    clips = [s for s in sizes if s[0] > 1]
    assert min(s[0] for s in clips) == 16 and max(s[0] for s in clips) == 204
    heights = {min(s[1], s[2]) for s in sizes}
    assert min(heights) == 144 and max(heights) == 720
    assert {"16:9", "4:3", "1:1"} <= set(mix.aspects)
    assert max(model.tokens(s) for s in clips) <= mix.max_clip_tokens


@pytest.mark.parametrize("name,top", [("sft-long", 128 * 1024), ("pretrain-long", 1024 * 1024)])
def test_text_mixes_have_heavy_tails(name, top):
    model = SCENARIOS["text"].model
    sizes = np.array(sample_sizes("text", name))
    assert sizes.max() <= top and sizes.min() >= 16
    assert sizes.max() > top / 2  # the tail reaches its end
    assert np.median(sizes) < 2048  # most documents are short ...
    assert long_token_share(model, sizes.tolist(), threshold=32 * 1024) > 0.2  # ... most tokens sit in long ones


def test_mix_names_are_checked():
    with pytest.raises(ValueError, match="not text; use it with --scenario video"):
        sample_sizes("text", "video-mix", num_samples=3)
    with pytest.raises(ValueError, match="unknown distribution 'nope'"):
        sample_sizes("text", "nope", num_samples=3)
    assert set(ALL_DISTRIBUTIONS) == set(DISTRIBUTIONS) | set(MIXES)


def test_simulate_takes_a_mix_by_name():
    import argparse

    from dcparallel.apps.simulate import _setup

    ns = argparse.Namespace(
        scenario=None,
        distribution="video-mix",
        lengths=None,
        world=8,
        gpus_per_node=8,
        seed=0,
        tokens_per_step=None,
        profile=None,
    )
    name, workload, cluster, _, _ = _setup(ns)
    assert name == "video-mix" and ns.scenario == "video" and workload.model.kind == "video"
    assert list(workload.sizes) == sample_sizes("video", "video-mix")
