"""Plots are written and show what they claim: idle spans appear in the idle colour."""

import matplotlib.image as mpimg
import numpy as np
import pytest

from dcparallel.report.plots import COLORS, plot_speedups, plot_timelines


def _pixels(png, hex_colour: str) -> int:
    img = mpimg.imread(png)[..., :3]
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - rgb).sum(-1) < 0.02).sum())


def test_timeline_shows_idle_only_where_there_is_idle(tmp_path):
    balanced = {0: [(0, 1, "busy"), (1, 1.1, "sync")], 1: [(0, 1, "busy"), (1, 1.1, "sync")]}
    skewed = {0: [(0, 2, "busy"), (2, 2.1, "sync")], 1: [(0, 0.5, "busy"), (0.5, 2, "idle"), (2, 2.1, "sync")]}
    a = plot_timelines({"dcp": balanced}, tmp_path / "a.png")
    b = plot_timelines({"bucket": skewed, "dcp": balanced}, tmp_path / "b.png", title="t")
    legend_patch = 600  # the legend shows each colour in a small patch
    assert _pixels(a, COLORS["idle"]) < legend_patch < _pixels(a, COLORS["busy"])
    assert _pixels(b, COLORS["idle"]) > 10 * legend_patch
    with pytest.raises(ValueError):
        plot_timelines({}, tmp_path / "c.png")


def test_speedup_bars(tmp_path):
    sims = [{"scenario": "video", "distribution": "short", "speedup_vs_bucket": {"bucket": 1.0, "dcp": 1.3}}]
    out = plot_speedups(sims, tmp_path / "s.png")
    assert out.stat().st_size > 5000


def test_busy_spans_coloured_by_sp_degree(tmp_path):
    from dcparallel.report.plots import SP_COLORS

    tl = {0: [(0, 1, "busy sp=2 recompute"), (1, 2, "busy sp=1")], 1: [(0, 1, "busy sp=2 recompute"), (1, 2, "idle")]}
    out = plot_timelines({"x": tl}, tmp_path / "t.png")
    assert _pixels(out, SP_COLORS[0]) > 1000  # SP=1 span
    assert _pixels(out, SP_COLORS[1]) > 500  # SP=2 spans (hatched: fewer solid pixels)


def test_step_boundaries_show_and_the_legend_sits_outside_the_data(tmp_path):
    from dcparallel.report.plots import _step_ends

    steps = {
        r: [(0, 1, "busy"), (1, 1.1, "sync"), (1.1, 2, "busy"), (2, 2.1, "sync"), (2.1, 3, "busy"), (3, 3.1, "sync")]
        for r in range(8)
    }
    assert _step_ends(steps) == [1.1, 2.1]  # the run's own end is no boundary
    no_sync = {r: [s for s in spans if s[2] != "sync"] for r, spans in steps.items()}
    a = plot_timelines({"p": steps}, tmp_path / "a.png")
    b = plot_timelines({"p": no_sync}, tmp_path / "b.png")
    dark = lambda png: int((mpimg.imread(png)[..., :3].sum(-1) < 0.4).sum())  # black: text and the dashes
    assert dark(a) > dark(b) + 150  # two dashed lines across the eight rank rows
    img = mpimg.imread(a)[..., :3]
    rgb = np.array([int(COLORS["idle"][i : i + 2], 16) / 255 for i in (1, 3, 5)])
    rows = np.nonzero((np.abs(img - rgb).sum(-1) < 0.02).any(axis=1))[0]
    assert len(rows) and rows.min() > 0.8 * img.shape[0]  # the only idle colour: the legend, below the panel


def test_many_ranks_stay_compact(tmp_path):
    tl = {r: [(0, 1 + r / 32, "busy sp=8"), (1 + r / 32, 2, "idle"), (2, 2.1, "sync")] for r in range(32)}
    out = plot_timelines({"bucket": tl, "dcp": tl}, tmp_path / "t32.png")
    assert mpimg.imread(out).shape[0] < 10 * 110  # two 32-rank panels in under 10 inches at 110 dpi
