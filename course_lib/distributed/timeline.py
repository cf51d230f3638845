"""The measured per-rank timeline of a step: compute spans and each bucket's collective.

:attr:`course_lib.distributed.ShardedDataParallel.timeline` is a list of
``{"rank", "name", "kind", "start", "end"}`` (seconds since ``zero_grad``): ``kind`` is
``"forward"`` / ``"backward"`` (one span per unit: a module owning parameters), ``"optimizer"``,
or the collective (``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``; ``name`` = its bucket),
a collective's span running from its issue to its completion (an async one: its future's callback,
or the wait that saw it done; on CUDA a blocking collective's end is when the host returned, as NCCL
runs on its own stream -- use ``overlap_grad_reduce`` / ``overlap_param_gather`` or a profiler there).
This module measures how much of the
communication ran under compute (:func:`overlap_seconds`) and draws it (:func:`plot_timeline`).
"""

from __future__ import annotations

COMPUTE = ("forward", "backward", "optimizer")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868",
          "all_reduce": "#8c564b", "reduce_scatter": "#c44e52", "all_gather": "#8172b3"}


def _merged(spans: list) -> list:
    """The union of ``[(start, end)]`` as sorted, disjoint intervals."""
    out: list = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap_seconds(timeline: list) -> float:
    """Seconds during which a collective ran while the rank computed.

    Compute is each pass as a whole -- from its first unit's start to its last unit's end, as the
    ops between units (activations, the loss) run there too -- and the optimizer step."""
    done = [e for e in timeline if e["end"] is not None]
    compute = []
    for kind in COMPUTE:
        spans = [e for e in done if e["kind"] == kind]
        if spans:
            compute.append((min(e["start"] for e in spans), max(e["end"] for e in spans)))
    total = 0.0
    for a0, a1 in _merged([(e["start"], e["end"]) for e in done if e["kind"] in COLLECTIVES]):
        for b0, b1 in _merged(compute):
            total += max(0.0, min(a1, b1) - max(a0, b0))
    return total


def plot_timeline(timelines: list, ax=None, title: str | None = None, *, compute=COMPUTE, collectives=COLLECTIVES,
                  colors=None):
    """One row per rank and lane (compute above, communication below) of ``timelines`` (a list of
    per-rank timelines, e.g. what each rank returned); milliseconds on the x axis. ``compute`` /
    ``collectives``: the event kinds of each lane; ``colors``: kind -> colour (default: this engine's).
    Returns the axes."""
    colors = COLORS if colors is None else colors
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 * len(timelines) + 1))
    labels, y = [], 0
    for tl in timelines:
        rank = tl[0]["rank"] if tl else "?"
        for lane, kinds in (("compute", compute), ("comm", collectives)):
            for e in tl:
                if e["kind"] in kinds and e["end"] is not None:
                    ax.barh(y, (e["end"] - e["start"]) * 1e3, left=e["start"] * 1e3, height=0.8,
                            color=colors[e["kind"]], edgecolor="white", linewidth=0.5)
            labels.append(f"rank {rank} {lane}")
            y += 1
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since zero_grad")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    return ax
