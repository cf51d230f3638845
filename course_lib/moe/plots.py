"""Pictures of an MoE run: the dense and expert grids on one rank map, the dispatch, tokens per expert per rank.

Pure functions (matplotlib is imported when a figure is drawn): Lab 08 uses them, and
:func:`write_figures` draws its theory's pictures into ``figures/`` (``python -m course_lib figures``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["GRID_ROWS", "group_index_table", "expert_placement", "expert_placement_html", "plot_two_grids",
           "plot_dispatch", "tokens_per_expert", "plot_tokens_per_expert", "MOE_PHASES", "phase_order",
           "plot_moe_timeline", "write_figures"]

# Rows per (source rank, expert) of the dispatch picture: 2 EP ranks, 4 experts, T·k = 8 rows each.
DISPATCH_EXAMPLE = ((3, 1, 2, 2), (1, 2, 4, 1))

# (label, which grid, token): the rows of the rank map, dense layers first.
GRID_ROWS = (("dense TP", "dense", "tp"), ("dense DP (with CP)", "dense", "dp-cp"), ("PP", "dense", "pp"),
             ("expert TP", "expert", "tp"), ("EP (all-to-all)", "expert", "ep"), ("expert DP", "expert", "dp"))


def group_index_table(grid) -> list[tuple[str, list[int]]]:
    """For each row of :data:`GRID_ROWS`: (label, [index of the group that holds rank r, r = 0..world-1])."""
    table = []
    for label, which, token in GRID_ROWS:
        groups = grid.groups(token) if which == "dense" else grid.expert_groups(token)
        index = {rank: i for i, group in enumerate(groups) for rank in group}
        table.append((label, [index[r] for r in range(grid.world_size)]))
    return table


def expert_placement(grid, num_experts: int) -> list[dict]:
    """Who holds which experts: one row per all-to-all (EP) group, in the group's order.

    Each row is ``{"ep_group": i, "ranks": [global ranks of the EP group], "experts": [[experts held by
    ranks[j]] for each j]}``; rank ``ranks[j]`` holds the ``num_experts / ep`` consecutive experts of EP
    rank ``j`` (Megatron's ``local_expert_indices``, megatron/core/transformer/moe/moe_layer.py). Ranks of
    one expert-TP group sit in different rows at the same position and hold the same experts, each a
    1/expert_tp shard of them. ``--num-experts`` must be divisible by ``ep`` (``rules.moe_experts``).
    """
    return [{"ep_group": i, "ranks": list(group), "experts": [grid.local_experts(r, num_experts) for r in group]}
            for i, group in enumerate(grid.expert_groups("ep"))]


def expert_placement_html(grid, num_experts: int, limit: int = 32) -> str:
    """:func:`expert_placement` as an HTML table (first ``limit`` EP groups), for the rank-map widget."""
    import html

    rows = []
    placement = expert_placement(grid, num_experts)
    for row in placement[:limit]:
        cells = " ".join(f"{r}: [{', '.join(map(str, e))}]" for r, e in zip(row["ranks"], row["experts"]))
        rows.append(f"<tr><td>{row['ep_group']}</td><td>[{', '.join(map(str, row['ranks']))}]</td>"
                    f"<td>{html.escape(cells)}</td></tr>")
    more = f"<tr><td colspan=3>… ({len(placement) - limit} more)</td></tr>" if len(placement) > limit else ""
    head = ("<tr><th>EP group</th><th>all-to-all runs in</th>"
            f"<th>rank: experts held (of {num_experts}; expert TP {grid.expert_tp} shards each)</th></tr>")
    return f"<table>{head}{''.join(rows)}{more}</table>"


def plot_two_grids(grid, ax=None):
    """The rank map: one column per rank, one row per kind of group (dense above, expert below); ranks
    of one group share a colour and the group's number. Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    table = group_index_table(grid)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 + 0.6 * grid.world_size, 0.5 * len(table) + 1.2))
    values = np.array([row for _, row in table], dtype=float)
    scaled = values / np.maximum(values.max(axis=1, keepdims=True), 1)
    ax.imshow(scaled, cmap="tab20c", aspect="auto", vmin=0, vmax=1.25)
    for i, (_, row) in enumerate(table):
        for r, g in enumerate(row):
            ax.text(r, i, str(g), ha="center", va="center", fontsize=9)
    ax.axhline(2.5, color="black", linewidth=2)
    ax.set_xticks(range(grid.world_size), [str(r) for r in range(grid.world_size)])
    ax.set_yticks(range(len(table)), [label for label, _ in table])
    ax.set_xlabel("global rank (cell: number of the rank's group)")
    etp = f", expert TP {grid.expert_tp}" if grid.expert_tp != grid.tp else ""
    ax.set_title(f"world {grid.world_size}: TP {grid.tp}, PP {grid.pp}, CP {grid.cp}, EP {grid.ep}{etp} -> "
                 f"dense DP {grid.dp}, expert DP {grid.expert_dp}", fontsize=10)
    return ax.figure


def plot_dispatch(tokens_per_expert=DISPATCH_EXAMPLE, ax=None):
    """The alltoall dispatch of ``tokens_per_expert`` (per source rank, rows per expert; rank j of the EP
    group holds experts j·L .. j·L+L-1): each rank's rows sorted by expert (left), cut into one chunk per
    destination, and what each rank receives, grouped by source rank (right). What each rank reads off
    the all-gathered counts (its ``output_split_sizes``) is written between them. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    ep, experts = len(tokens_per_expert), len(tokens_per_expert[0])
    local = experts // ep
    colors = plt.get_cmap("tab10").colors
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.3 * ep + 1.2))
    row_h = 0.8 / max(sum(c) for c in tokens_per_expert)

    def bar(x, y, pieces, label):
        """pieces: [(expert, rows, source)] drawn left to right; returns the x after the bar."""
        ax.text(x - 0.05, y + 0.4, label, ha="right", va="center", fontsize=8)
        for expert, rows, source in pieces:
            for _ in range(rows):
                ax.add_patch(Rectangle((x, y), row_h * 3, 0.8, facecolor=colors[expert], edgecolor="black",
                                       linewidth=0.4, hatch="///" if source else ""))
                x += row_h * 3
        return x

    for src, counts in enumerate(tokens_per_expert):
        y = ep - 1 - src
        bar(0.8, y, [(e, n, None) for e, n in enumerate(counts)], f"rank {src} sends")
        for dst in range(1, ep):                   # where the rows for the next rank's experts begin
            cut = 0.8 + row_h * 3 * sum(counts[:dst * local])
            ax.plot([cut, cut], [y - 0.08, y + 0.88], color="black", linewidth=2.5)
    for dst in range(ep):
        y = ep - 1 - dst
        mine = [(e, tokens_per_expert[src][e], src) for src in range(ep) for e in range(dst * local, (dst + 1) * local)]
        bar(8.8, y, mine, f"rank {dst} receives")
        counts = [[tokens_per_expert[src][e] for e in range(dst * local, (dst + 1) * local)] for src in range(ep)]
        ax.text(5.3, y + 0.4, f"counts on rank {dst}\n[source][local expert]:\n{counts}", ha="center", va="center",
                fontsize=7)
    ax.annotate("", xy=(7.0, ep / 2), xytext=(3.6, ep / 2), arrowprops=dict(arrowstyle="->", lw=1.5))
    handles = [Rectangle((0, 0), 1, 1, facecolor=colors[e]) for e in range(experts)]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="///"))
    ax.legend(handles, [f"expert {e} (on rank {e // local})" for e in range(experts)] + ["rows of rank 1"],
              fontsize=7, ncol=experts + 1, loc="lower center", bbox_to_anchor=(0.5, -0.3))
    ax.set_xlim(-0.6, 12)
    ax.set_ylim(-0.2, ep + 0.3)
    ax.axis("off")
    ax.set_title(f"Dispatch on {ep} EP ranks, {experts} experts: 1) all-gather of every rank's counts (E numbers "
                 f"each),\n2) all-to-all of the rows and their gates, cut per destination (thick line), uneven "
                 f"splits; the chunk for a rank's own experts stays on it", fontsize=9)
    return ax.figure


def write_figures(out_dir) -> list[Path]:
    """Lab 08's theory pictures: the two grids of world 8, TP 2, PP 2, EP 2, expert TP 1
    (``moe_two_grids_8_tp2_pp2_ep2.png``) and the dispatch (``moe_dispatch_ep2.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.safe_files import save_and_close_figure
    from course_lib.topology import RankGrid

    return [save_and_close_figure(plot_two_grids(RankGrid(8, tp=2, pp=2, ep=2, expert_tp=1)),
                                  Path(out_dir) / "moe_two_grids_8_tp2_pp2_ep2.png"),
            save_and_close_figure(plot_dispatch(), Path(out_dir) / "moe_dispatch_ep2.png")]


def tokens_per_expert(indices_by_rank, num_experts: int) -> list[list[int]]:
    """Routing slots per expert, one list per rank: ``indices_by_rank`` is a list of [T, k] expert ids."""
    import torch

    return [torch.bincount(torch.as_tensor(ix).flatten(), minlength=num_experts).tolist() for ix in indices_by_rank]


def plot_tokens_per_expert(panels: dict, ep: int):
    """One panel per entry of ``panels`` (title -> per-rank counts from :func:`tokens_per_expert`): stacked
    bars of the slots each expert receives from each rank; the dashed line is a perfectly balanced load and
    the shading marks the experts each EP rank holds. Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.2), sharey=True, squeeze=False)
    for ax, (title, counts) in zip(axes[0], panels.items()):
        counts = np.asarray(counts)
        ranks, experts = counts.shape
        bottom = np.zeros(experts)
        for r in range(ranks):
            ax.bar(range(experts), counts[r], bottom=bottom, label=f"from rank {r}")
            bottom += counts[r]
        ax.axhline(counts.sum() / experts, color="black", linestyle="--", linewidth=1)
        per = experts // ep
        for j in range(0, ep, 2):
            ax.axvspan(j * per - 0.5, (j + 1) * per - 0.5, color="grey", alpha=0.12)
        ax.set_title(f"{title}: busiest EP rank {max(counts.sum(0).reshape(ep, per).sum(1)) / (counts.sum() / ep):.2f}"
                     f"× its fair share", fontsize=10)
        ax.set_xlabel("expert (shaded: held by one EP rank)")
        ax.set_xticks(range(experts))
    axes[0][0].set_ylabel("routing slots")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig


# The phases of one MoE layer's forward, in the order they run (Megatron's MoELayer.forward:
# router -> token_dispatcher.token_permutation (all-to-all) -> experts -> token_unpermutation (all-to-all)).
MOE_PHASES = ("route", "dispatch", "experts", "combine")
MOE_COLORS = {"route": "#55a868", "dispatch": "#c44e52", "experts": "#4c72b0", "combine": "#8172b3",
              "forward": "#bbbbbb", "backward": "#dd8452"}


def phase_order(timeline: list) -> list[str]:
    """The ``kind`` s of one rank's timeline (``{"rank", "name", "kind", "start", "end"}`` spans, seconds,
    as in :mod:`course_lib.distributed.timeline`) in the order they started; spans still open are skipped."""
    return [e["kind"] for e in sorted((e for e in timeline if e["end"] is not None), key=lambda e: e["start"])]


def plot_moe_timeline(timelines: list, ax=None, title: str | None = None):
    """Per rank two rows of ``timelines`` (one list of spans per rank): compute (``route``, ``experts``,
    and ``forward`` / ``backward`` spans of other work) above, the two all-to-alls (``dispatch``,
    ``combine``) below; milliseconds on the x axis. Drawn by the course engine's timeline plot,
    :func:`course_lib.distributed.timeline.plot_timeline`, with the MoE phases as its lanes. Returns the axes."""
    from course_lib.distributed.timeline import plot_timeline

    ax = plot_timeline(timelines, ax=ax, title=title, compute=("route", "experts", "forward", "backward"),
                       collectives=("dispatch", "combine"), colors=MOE_COLORS)
    ax.set_xlabel("ms since the step began")
    return ax
