"""Pictures of pipeline schedules: Gantt charts, bubble vs micro-batches, activation memory.

Every function returns a matplotlib ``Figure`` (callers show it). Colours: F blue,
B orange, W green; with interleaving, chunk ``c`` gets a lighter shade per chunk.
Micro-batch ids are written in the boxes when they fit.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from course_lib.pipeline.bubbles import bubble_fraction
from course_lib.pipeline.schedules import build_schedule
from course_lib.pipeline.simulate import Timeline, simulate

COLORS = {"F": "#1f77b4", "B": "#ff7f0e", "W": "#2ca02c"}


def _shade(color: str, chunk: int, vp: int) -> tuple:
    """Chunk 0 in full colour, later chunks mixed with white."""
    r, g, b = to_rgb(color)
    mix = 0.55 * chunk / max(vp - 1, 1)
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix)


def gantt(timeline: Timeline, ax=None, title: Optional[str] = None, unit: str = "", show_ids: bool = True):
    """Ranks (rows, rank 0 on top) x time; one box per action, coloured by kind, micro-batch id inside."""
    s = timeline.schedule
    p, vp = s.pp_size, s.vp_size
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(11, 0.45 * p + 1.3))
    else:
        fig = ax.figure
    t0, span = timeline.start, timeline.makespan or 1.0
    for r, events in enumerate(timeline.events):
        for e in events:
            width = e.end - e.start
            ax.barh(r, width, left=e.start - t0, height=0.8,
                    color=_shade(COLORS[e.action.kind], e.action.chunk_id, vp), edgecolor="white", linewidth=0.5)
            if show_ids and width / span > 0.012:
                ax.text(e.start - t0 + width / 2, r, str(e.action.microbatch), ha="center", va="center",
                        fontsize=7 if width / span > 0.02 else 5, color="white" if e.action.chunk_id == 0 else "black")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time{f' ({unit})' if unit else ''}")
    kinds = sorted({e.action.kind for ev in timeline.events for e in ev}, key="FBW".index)
    handles = [Patch(color=COLORS[k], label={"F": "forward", "B": "backward", "W": "weight grad"}[k]) for k in kinds]
    if vp > 1:
        handles += [Patch(color=_shade("#777777", c, vp), label=f"chunk {c}") for c in range(vp)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title is None:
        title = (f"{timeline.source} {s.name}: p={p}, m={s.num_microbatches}" + (f", v={vp}" if vp > 1 else "")
                 + f" -- bubble fraction {timeline.bubble_fraction:.3f}")
    ax.set_title(title, fontsize=10)
    if own:
        fig.tight_layout()
    return fig


def gantt_compare(simulated: Timeline, measured: Timeline, unit: str = "s"):
    """The simulated and the measured timeline of the same schedule, one above the other, same time axis."""
    p = simulated.pp_size
    fig, axes = plt.subplots(2, 1, figsize=(11, 0.9 * p + 2.6), sharex=True)
    gantt(simulated, ax=axes[0], unit=unit)
    gantt(measured, ax=axes[1], unit=unit)
    end = max(simulated.makespan, measured.makespan)
    axes[0].set_xlim(0, end)
    fig.tight_layout()
    return fig


def bubble_vs_microbatches(pps: Sequence[int] = (2, 4, 8), vps: Sequence[int] = (1, 2),
                           microbatches: Iterable[int] = range(1, 33), simulate_points: bool = True,
                           highlight_m: Optional[int] = 8):
    """Bubble fraction ``(p - 1) / (v m)`` against m; dots are simulated schedules (1F1B / interleaved)."""
    ms = list(microbatches)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for i, p in enumerate(pps):
        color = plt.cm.tab10(i)
        for vp in vps:
            style = "-" if vp == 1 else "--"
            ax.plot(ms, [bubble_fraction(p, m, vp) for m in ms], style, color=color,
                    label=f"p={p}, v={vp}  (p-1)/(v m)")
            if simulate_points:
                xs, ys = [], []
                for m in ms:
                    try:
                        s = build_schedule("1f1b" if vp == 1 else "interleaved", p, m, vp)
                    except ValueError:
                        continue  # interleaved needs m % p == 0
                    xs.append(m)
                    ys.append(simulate(s, 1.0, 2.0).bubble_fraction)
                ax.plot(xs, ys, "o", color=color, markersize=3.5, markerfacecolor="white" if vp > 1 else color)
    if highlight_m:
        ax.axvline(highlight_m, color="grey", lw=0.8, ls=":")
        for p in pps:
            ax.annotate(f"{bubble_fraction(p, highlight_m):.3f}", (highlight_m, bubble_fraction(p, highlight_m)),
                        textcoords="offset points", xytext=(4, 2), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("micro-batches per iteration m")
    ax.set_ylabel("bubble time / ideal time")
    ax.set_title("Pipeline bubble vs micro-batches (lines: formula, dots: simulated schedules)", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def memory_bars(timelines: Sequence[Timeline], labels: Optional[Sequence[str]] = None):
    """Peak live activations per rank, in units of one micro-batch's activations of a whole stage."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    n = len(timelines)
    width = 0.8 / max(n, 1)
    for i, tl in enumerate(timelines):
        vp = tl.schedule.vp_size
        label = labels[i] if labels else f"{tl.schedule.name}" + (f" v={vp}" if vp > 1 else "")
        xs = [r + (i - (n - 1) / 2) * width for r in range(tl.pp_size)]
        ys = [k / vp for k in tl.peak_activations]
        ax.bar(xs, ys, width=width, label=label)
    ax.set_xticks(range(max(tl.pp_size for tl in timelines)))
    ax.set_xticklabels([f"rank {r}" for r in range(max(tl.pp_size for tl in timelines))])
    ax.set_ylabel("peak activations (micro-batches)")
    top = max(k / tl.schedule.vp_size for tl in timelines for k in tl.peak_activations)
    ax.set_ylim(0, top * 1.4)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=min(n, 5), loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def write_figures(out_dir) -> list:
    """Write the lab's figures (simulated Gantt charts for p=4, m=8 and bubble vs m) as PNG; return paths."""
    from pathlib import Path

    from course_lib.safe_files import save_figure_atomic

    out = Path(out_dir)
    paths = []
    for name, vp, times in (("gpipe", 1, (1, 2, 0)), ("1f1b", 1, (1, 2, 0)), ("interleaved", 2, (1, 2, 0)),
                            ("zb-h1", 1, (1, 1, 1)), ("zb-h2", 1, (1, 1, 1))):
        fig = gantt(simulate(build_schedule(name, 4, 8, vp), *times))
        paths.append(save_figure_atomic(fig, out / f"pipeline_gantt_{name}_p4_m8{f'_v{vp}' if vp > 1 else ''}.png",
                                        dpi=120))
        plt.close(fig)
    fig = bubble_vs_microbatches()
    paths.append(save_figure_atomic(fig, out / "pipeline_bubble_vs_m.png", dpi=120))
    plt.close(fig)
    return paths
