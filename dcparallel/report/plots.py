"""Plots people look at instead of reading tables: per-rank timelines and speedup bars.

`plot_timelines`: one panel per policy, one row per rank, time on x: busy micro-batches,
idle waiting for the slowest group, and the gradient sync, step after step (boundaries
dashed), all panels on one time axis so a faster policy is visibly shorter; legends sit
outside the data. `plot_speedups`: grouped bars of each
policy's speedup over the tuned bucket baseline per scenario and distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

#: (start s, end s, kind) spans of one rank: kind "busy" | "idle" | "sync", as
#: SimResult.rank_timeline gives; busy spans may say more: "busy sp=2", "busy sp=2 recompute"
Span = tuple[float, float, str]

#: legend label -> (colour, hatch, sort key) of the span kinds a figure draws
Legend = dict[str, tuple[str, str | None, tuple]]

COLORS = {"busy": "#2f7ed8", "idle": "#f15c80", "sync": "#434348"}
#: busy colours by SP degree (1, 2, 4, ...), recomputing micro-batches hatched
SP_COLORS = ["#2f7ed8", "#8085e9", "#90ed7d", "#f7a35c", "#e4d354", "#2b908f"]


def _style(kind: str) -> tuple[str, str | None, str]:
    """(colour, hatch, legend label) of a span kind."""
    if not kind.startswith("busy") or kind == "busy":
        return COLORS[kind], None, kind if kind != "idle" else "idle (waiting for the slowest group)"
    sp = int(kind.split("sp=")[1].split()[0])
    colour = SP_COLORS[min(len(SP_COLORS) - 1, max(sp, 1).bit_length() - 1)]
    rec = "recompute" in kind
    return colour, "////" if rec else None, f"busy, SP={sp}" + (", recomputing" if rec else "")


def _order(kind: str) -> tuple:
    """Legend order: busy by SP degree (plain before recomputing), then idle, then sync."""
    if kind.startswith("busy"):
        sp = int(kind.split("sp=")[1].split()[0]) if "sp=" in kind else 0
        return (0, sp, "recompute" in kind)
    return (1 if kind == "idle" else 2,)


def _step_ends(tl: Mapping[int, Sequence[Span]]) -> list[float]:
    """Where the steps of a timeline end: the ends of its gradient-sync spans (every rank
    syncs at the end of every step), the run's own end left out."""
    ends = sorted({round(b, 9) for spans in tl.values() for _, b, k in spans if k == "sync"})
    run_end = max((s[1] for spans in tl.values() for s in spans), default=0.0)
    return [t for t in ends if t < run_end - 1e-9]


def _draw_spans(ax: Any, tl: Mapping[int, Sequence[Span]], legend: Legend) -> None:
    """One row per rank of the panel ``ax``, its spans coloured by kind; each kind drawn goes
    into ``legend`` (label -> colour, hatch, legend order)."""
    thin = len(tl) > 8
    for row, rank in enumerate(sorted(tl)):
        for kind in sorted({k for _, _, k in tl[rank]}):
            bars = [(a, b - a) for a, b, k in tl[rank] if k == kind and b > a]
            if bars:
                colour, hatch, label = _style(kind)
                edge = "white" if kind.startswith("busy") and not thin else "none"
                ax.broken_barh(
                    bars,
                    (row - 0.45, 0.9) if thin else (row - 0.4, 0.8),
                    facecolors=colour,
                    hatch=hatch,
                    edgecolor=edge,
                    linewidth=0.3,
                )
                legend[label] = (colour, hatch, _order(kind))


def _draw_panel(ax: Any, name: str, tl: Mapping[int, Sequence[Span]], legend: Legend, end: float) -> None:
    """The panel of policy ``name``: its ranks' spans, step boundaries dashed (up to 400), at
    most about 8 ranks labelled, a title with its run time, steps and idle share; time axis
    to ``end`` seconds."""
    busy_total = sum(b - a for spans in tl.values() for a, b, k in spans if k.startswith("busy"))
    idle_total = sum(b - a for spans in tl.values() for a, b, k in spans if k == "idle")
    run_end = max((s[1] for spans in tl.values() for s in spans), default=0.0)
    thin = len(tl) > 8
    _draw_spans(ax, tl, legend)
    steps = _step_ends(tl)
    for t in steps if len(steps) <= 400 else ():
        ax.axvline(t, color="black", linestyle=(0, (2, 2)), linewidth=0.9, zorder=3)
    every = max(1, -(-len(tl) // 8))  # label at most ~8 ranks a panel
    ranks = sorted(tl)
    ax.set_yticks(range(0, len(tl), every))
    ax.set_yticklabels([f"rank {ranks[i]}" for i in range(0, len(tl), every)], fontsize=8 if thin else 10)
    ax.set_ylim(-0.6, len(tl) - 0.4)
    ax.invert_yaxis()
    share = idle_total / (busy_total + idle_total) if busy_total + idle_total else 0.0
    ax.set_title(
        f"{name}: {run_end:.1f} s, {len(steps) + 1} steps, ranks idle {100 * share:.0f}% of compute time",
        loc="left",
        fontsize=10,
    )
    ax.set_xlim(0, end * 1.01)


def _legend_below(fig: Any, legend: Legend) -> None:
    """The figure's legend below the panels: the kinds drawn, idle and sync always."""
    for k in ("idle", "sync"):
        legend.setdefault(_style(k)[2], (COLORS[k], None, _order(k)))
    handles = [
        Patch(facecolor=c, hatch=h, edgecolor="white", label=label)
        for label, (c, h, _) in sorted(legend.items(), key=lambda x: x[1][2])
    ]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=9, frameon=False)


def plot_timelines(
    timelines: Mapping[str, Mapping[int, Sequence[Span]]],
    path: str | Path,
    title: str = "",
    max_seconds: float | None = None,
) -> Path:
    """Writes a PNG with one panel per policy (e.g. {"bucket": {0: spans, 1: spans}, ...}):
    step boundaries dashed, the legend below the panels; many ranks (32 and more) get thin
    rows and every k-th rank labelled, so the figure stays compact."""
    if not timelines:
        raise ValueError("no timelines to plot")
    names = list(timelines)
    end = max((s[1] for tl in timelines.values() for spans in tl.values() for s in spans), default=1.0)
    end = max_seconds or end
    num_ranks = max(len(tl) for tl in timelines.values())
    row_h = 0.35 if num_ranks <= 8 else max(0.09, 2.8 / num_ranks)  # inches per rank row
    heights = [row_h * max(1, len(timelines[n])) + 0.45 for n in names]
    legend_h = 0.45
    fig_h = (0.3 if title else 0.1) + sum(heights) + 0.45 + legend_h
    fig, axes = plt.subplots(
        len(names), 1, figsize=(12, fig_h), squeeze=False, sharex=True, gridspec_kw={"height_ratios": heights}
    )
    legend: Legend = {}
    for ax, name in zip(axes[:, 0], names):
        _draw_panel(ax, name, timelines[name], legend, end)
    axes[-1, 0].set_xlabel("seconds (dashed lines: step boundaries)")
    _legend_below(fig, legend)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    top = 1 - (0.3 if title else 0.1) / fig_h
    fig.tight_layout(rect=(0, legend_h / fig_h, 1, top))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_speedups(
    simulated: Sequence[dict],
    path: str | Path,
    policies: Sequence[str] | None = None,
    title: str = "Speedup over the tuned bucket baseline (simulated)",
) -> Path:
    """Grouped bars from `simulate --json` objects (each with "speedup_vs_bucket")."""
    if not simulated:
        raise ValueError("no simulation results to plot")
    policies = list(policies or simulated[0]["speedup_vs_bucket"])
    labels = [f"{r['scenario']}\n{r['distribution']}" for r in simulated]
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(simulated)), 4.5))
    cmap = plt.get_cmap("tab10")
    for j, p in enumerate(policies):
        xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(simulated))]
        ys = [r["speedup_vs_bucket"].get(p, 0.0) for r in simulated]
        bars = ax.bar(xs, ys, width, label=p, color=cmap(j % 10))
        for b, y in zip(bars, ys):
            ax.text(
                b.get_x() + b.get_width() / 2, y + 0.02, f"{y:.2f}", ha="center", va="bottom", fontsize=6, rotation=90
            )
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(simulated)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("speedup (x)")
    ax.set_title(title, loc="left", fontsize=11)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)  # outside the bars
    ax.set_ylim(0, max(r["speedup_vs_bucket"].get(p, 0) for r in simulated for p in policies) * 1.25)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_paper_scale_timeline(path: str | Path, world: int = 32) -> Path:
    """Per-rank timelines of the first 4 steps of video / short on `world` H200s under bucket
    and dcp, simulated (`sim.run.scenario_timelines`)."""
    from dcparallel.sim.run import scenario_timelines

    return plot_timelines(
        scenario_timelines("video", "short", world),
        path,
        title=f"video / short on {world} x H200, first 4 steps (simulated): bucket vs dcp",
    )
