"""The rank map: pictures of the rank grid, all drawn from one ``RankGrid``.

* ``rank_map(grid)`` -> ``graphviz.Digraph``: pipeline stages as clusters, TP
  groups as boxes of rank cells, PP send/recv as solid arrows, DP links dashed,
  CP links dotted; ``highlight=r`` colours rank r's groups.
* ``rank_map_figure(grid)`` -> matplotlib ``Figure``: the same map without Graphviz.
* ``save(obj, path)``: SVG/PNG/PDF (and DOT for Graphviz) chosen by suffix.

The groups and what runs in each follow Megatron-LM's ``initialize_model_parallel``
(``megatron/core/parallel_state.py``; see :data:`course_lib.topology.grid.MEGATRON_GROUPS`).
The picture of where PP and TP cut the model is :mod:`course_lib.topology.boundaries`.
"""

from __future__ import annotations

from pathlib import Path

from course_lib.topology.config import ParallelConfig
from course_lib.topology.grid import RankGrid
from course_lib.rules import UsageError

COLORS = {
    "self": "#d62728",  # the highlighted rank
    "tp": "#ff7f0e",    # tensor parallel: orange boxes
    "pp": "#1f77b4",    # pipeline: blue arrows
    "dp": "#2ca02c",    # data parallel: green dashed
    "cp": "#9467bd",    # context parallel: purple dotted
}
LIGHT = {"self": "#d62728", "tp": "#ffd8b0", "pp": "#c6dcf0", "dp": "#c9ebc9", "cp": "#e2d5ee"}
FORMATS_GRAPHVIZ = (".svg", ".png", ".pdf", ".dot")
FORMATS_MATPLOTLIB = (".svg", ".png", ".pdf")


# ----------------------------------------------------------------------------------------
# Pure helpers (tested): layout and highlight roles
# ----------------------------------------------------------------------------------------

def highlight_roles(grid: RankGrid, rank: int | None) -> dict[int, str]:
    """``{other_rank: role}`` for the ranks sharing a group with ``rank``:
    'self', and 'tp' / 'cp' / 'dp' / 'pp' for its partners in each group (groups of
    different axes meet only at ``rank`` itself, so every rank gets one role)."""
    if rank is None:
        return {}
    roles = {}
    for axis in ("tp", "cp", "dp", "pp"):
        if grid.sizes[axis] > 1:
            for r in grid.group_of(rank, axis):
                roles[r] = axis
    roles[grid._check_rank(rank)] = "self"
    return roles


def stage_layout(grid: RankGrid) -> list[list[list[int]]]:
    """``layout[stage][box]`` = the TP group (ranks in tp order) of each box in a
    stage, boxes ordered by their (cp, dp) coordinates (DP partners side by
    side) so that a box sits at the same position in every stage (PP partners line
    up vertically)."""
    stages: list[list[tuple[tuple[int, ...], list[int]]]] = [[] for _ in range(grid.pp)]
    for group in grid.groups("tp"):
        c = grid.coords(group[0])
        key = (c["cp"], c["dp"])
        stages[c["pp"]].append((key, group))
    return [[g for _, g in sorted(s)] for s in stages]


def _box_label(grid: RankGrid, group: list[int]) -> str:
    c = grid.coords(group[0])
    parts = [f"dp {c['dp']}"] if grid.dp > 1 else []
    if grid.cp > 1:
        parts.append(f"cp {c['cp']}")
    if grid.ep > 1:
        parts.append(f"ep {grid.expert_coords(group[0])['ep']}")
    return "TP group" + (" · " + " ".join(parts) if parts else "")


def _stage_label(grid: RankGrid, stage: int, layers: list[range] | None) -> str:
    s = f"pipeline stage {stage}"
    if layers is not None:
        r = layers[stage]
        s += f" · layers {r.start}–{r.stop - 1}" if len(r) else " · no layers"
    return s


def _layers(grid: RankGrid, num_layers: int | None) -> list[range] | None:
    if num_layers is None:
        return None
    return ParallelConfig(grid.world_size, tp=grid.tp, pp=grid.pp, cp=grid.cp, num_layers=num_layers,
                          order=grid.order_str).layer_ranges()


def _title(grid: RankGrid, highlight: int | None) -> str:
    sizes = f"tp {grid.tp} × cp {grid.cp} × dp {grid.dp} × pp {grid.pp}" if grid.cp > 1 else \
        f"tp {grid.tp} × dp {grid.dp} × pp {grid.pp}"
    if grid.ep > 1:
        sizes += f" (ep {grid.ep})"
    t = f"{grid.world_size} ranks = {sizes}   order {grid.order_str} (first axis fastest)"
    if highlight is not None:
        g = grid.groups_of(highlight, [a for a in ("tp", "cp", "dp", "pp") if grid.sizes[a] > 1])
        t += f"\nrank {highlight}: " + "  ".join(f"{k} {v}" for k, v in g.items()) if g else \
            f"\nrank {highlight}"
    return t


LEGEND_TEXT = ("orange box = TP group (all-reduce inside)    blue arrow = PP send/recv (activations forward, "
               "gradients back)\ngreen dashed = DP (gradient all-reduce)    purple dotted = CP (K/V ring)    "
               "box-to-box links join the ranks at the same position in both boxes")


def _auto_detail(grid: RankGrid, detail: str) -> str:
    if detail not in ("auto", "ranks", "groups"):
        raise UsageError(f"detail={detail!r} must be 'auto', 'ranks' or 'groups'")
    if detail == "auto":
        return "ranks" if grid.world_size <= 16 else "groups"
    return detail


def links(grid: RankGrid, detail: str = "ranks", highlight: int | None = None,
          per_rank: tuple[str, ...] = ()) -> list[tuple[str, int, int, bool]]:
    """The PP/DP/CP links to draw: ``(axis, rank_a, rank_b, bold)`` for consecutive
    members of every group (a PP link points to the next stage). With
    ``detail='groups'`` links between the same two TP boxes are merged into one
    (represented by its first rank pair) except for axes in ``per_rank``;
    ``bold`` marks links inside the highlighted rank's groups."""
    roles = highlight_roles(grid, highlight)
    box_of = {r: (s, b) for s, boxes in enumerate(stage_layout(grid)) for b, g in enumerate(boxes) for r in g}
    out: dict[tuple, list] = {}
    for axis in ("pp", "dp", "cp"):
        if grid.sizes[axis] == 1:
            continue
        for group in grid.groups(axis):
            for a, b in zip(group, group[1:]):
                bold = highlight is not None and roles.get(a) in ("self", axis) and roles.get(b) in ("self", axis)
                key = (axis, box_of[a], box_of[b]) if detail == "groups" and axis not in per_rank else (axis, a, b)
                if key in out:
                    out[key][3] = out[key][3] or bold
                else:
                    out[key] = [axis, a, b, bold]
    return [tuple(v) for v in out.values()]


# ----------------------------------------------------------------------------------------
# Graphviz rank map
# ----------------------------------------------------------------------------------------

def rank_map(grid: RankGrid, highlight: int | None = None, num_layers: int | None = None,
             detail: str = "auto"):
    """The rank map as a ``graphviz.Digraph`` (render with ``save`` or display it).

    DP and CP links join TP boxes (box i's k-th rank talks to box j's k-th rank);
    PP arrows go rank to rank with ``detail='ranks'`` or box to box with
    ``'groups'``; ``'auto'`` picks ranks up to 16 ranks. ``num_layers`` adds each stage's layer range.
    """
    import graphviz

    detail = _auto_detail(grid, detail)
    roles = highlight_roles(grid, highlight)
    layers = _layers(grid, num_layers)
    layout = stage_layout(grid)
    box_of = {r: (s, b) for s, boxes in enumerate(layout) for b, g in enumerate(boxes) for r in g}

    dot = graphviz.Digraph("rank_map", graph_attr={
        "rankdir": "TB", "compound": "true", "newrank": "true", "nodesep": "0.25", "ranksep": "0.55",
        "fontname": "Helvetica", "fontsize": "12", "labelloc": "t", "labeljust": "l",
        "label": _title(grid, highlight) + "\n" + LEGEND_TEXT + "\n"},
        node_attr={"shape": "plaintext", "fontname": "Helvetica", "margin": "0"},
        edge_attr={"arrowsize": "0.6"})

    cell_w = 12 + 9 * len(str(grid.world_size - 1))  # every cell as wide as the widest rank number
    for s, boxes in enumerate(layout):
        with dot.subgraph(name=f"cluster_stage{s}") as c:
            c.attr(label=_stage_label(grid, s, layers), style="rounded,filled", fillcolor="#f4f8fc",
                   color=COLORS["pp"], fontcolor=COLORS["pp"], fontsize="11", labeljust="l")
            for b, group in enumerate(boxes):
                cells = []
                for k, r in enumerate(group):
                    role = roles.get(r)
                    bg = LIGHT[role] if role else "white"
                    txt = f'<B><FONT COLOR="white">{r}</FONT></B>' if role == "self" else str(r)
                    cells.append(f'<TD PORT="p{k}" BGCOLOR="{bg}" WIDTH="{cell_w}">{txt}</TD>')
                head = (f'<TR><TD COLSPAN="{len(group)}" BGCOLOR="#fff1e0"><FONT POINT-SIZE="8">'
                        f'{_box_label(grid, group)}</FONT></TD></TR>')
                label = (f'<<TABLE BORDER="2" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3" '
                         f'COLOR="{COLORS["tp"]}">{head}<TR>{"".join(cells)}</TR></TABLE>>')
                c.node(f"s{s}b{b}", label=label)
            if len(boxes) > 1:  # keep the boxes in (cp, dp) order, left to right, in every stage
                with c.subgraph() as row:
                    row.attr(rank="same")
                    for b in range(len(boxes)):
                        row.node(f"s{s}b{b}")
                    for b in range(len(boxes) - 1):
                        row.edge(f"s{s}b{b}", f"s{s}b{b + 1}", style="invis")

    def port(r):
        s, b = box_of[r]
        return f"s{s}b{b}", f"p{layout[s][b].index(r)}"

    # DP/CP partners sit in boxes side by side: one straight link per box pair reads
    # best; PP links go rank to rank (detail='ranks') or box to box.
    for axis, a, b, bold in links(grid, "groups", highlight, per_rank=("pp",) if detail == "ranks" else ()):
        (na, pa), (nb, pb) = port(a), port(b)
        width = "2.8" if bold else ("1.6" if axis == "cp" else "1.2")
        style = {"pp": dict(color=COLORS["pp"], weight="10"),
                 "dp": dict(color=COLORS["dp"], style="dashed", dir="none", constraint="false"),
                 "cp": dict(color=COLORS["cp"], style="dotted", dir="none", constraint="false")}[axis]
        if detail == "ranks" and axis == "pp":
            dot.edge(f"{na}:{pa}:s", f"{nb}:{pb}:n", penwidth=width, **style)
        else:
            dot.edge(na, nb, penwidth=width, **style)
    return dot


# ----------------------------------------------------------------------------------------
# Matplotlib rank map
# ----------------------------------------------------------------------------------------

def rank_map_figure(grid: RankGrid, highlight: int | None = None, num_layers: int | None = None,
                    detail: str = "auto", ax=None):
    """The rank map drawn with matplotlib; returns the ``Figure``.

    Rows are pipeline stages (stage 0 on top), each row a line of TP boxes whose
    cells are ranks; PP arrows go down between stages, DP links are dashed arcs
    under a row, CP links dotted arcs above it.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    detail = _auto_detail(grid, detail)
    roles = highlight_roles(grid, highlight)
    layers = _layers(grid, num_layers)
    layout = stage_layout(grid)
    nbox, tp = len(layout[0]), grid.tp
    cell, gap, row_h = 1.0, 0.6, 3.0
    width = nbox * tp * cell + (nbox - 1) * gap
    pos = {}  # rank -> (x centre, y centre)
    for s, boxes in enumerate(layout):
        y = -s * row_h
        for b, group in enumerate(boxes):
            x0 = b * (tp * cell + gap)
            for k, r in enumerate(group):
                pos[r] = (x0 + (k + 0.5) * cell, y)

    if ax is None:
        fig_w = min(max(7.0, 0.32 * width + 2.5), 22.0)
        fig, ax = plt.subplots(figsize=(fig_w, 1.15 * grid.pp + 1.6))
    else:
        fig = ax.figure
    fs = 9 if width <= 40 else (7 if width <= 80 else 5.5)

    for s, boxes in enumerate(layout):
        y = -s * row_h
        ax.add_patch(Rectangle((-0.35, y - 1.0), width + 0.7, 1.85, facecolor="#f4f8fc",
                               edgecolor=COLORS["pp"], lw=1.0, zorder=0))
        ax.text(-0.35, y + 0.9, _stage_label(grid, s, layers), fontsize=fs, color=COLORS["pp"],
                va="bottom", ha="left", zorder=5)
        for b, group in enumerate(boxes):
            x0 = b * (tp * cell + gap)
            ax.add_patch(Rectangle((x0, y - 0.4), tp * cell, 0.8, fill=False, edgecolor=COLORS["tp"],
                                   lw=2.0, zorder=3))
            if nbox * tp <= 64:
                ax.text(x0 + 0.05, y + 0.45, _box_label(grid, group).replace("TP group · ", ""),
                        fontsize=fs - 1.5, ha="left", va="bottom", color="#7a4a00", zorder=5)
            for k, r in enumerate(group):
                role = roles.get(r)
                ax.add_patch(Rectangle((x0 + k * cell, y - 0.4), cell, 0.8,
                                       facecolor=LIGHT[role] if role else "white",
                                       edgecolor="#888888", lw=0.5, zorder=2))
                ax.text(x0 + (k + 0.5) * cell, y, str(r), ha="center", va="center", fontsize=fs,
                        color="white" if role == "self" else "black",
                        fontweight="bold" if role == "self" else "normal", zorder=4)

    box_x = {r: b * (tp * cell + gap) + tp * cell / 2 for boxes in layout for b, g in enumerate(boxes) for r in g}
    for axis, a, b, bold in links(grid, detail, highlight, per_rank=("pp",)):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        if detail == "groups" and axis != "pp":  # one link per box pair, between box centres
            xa, xb = box_x[a], box_x[b]
        lw = 2.4 if bold else 1.0
        if axis == "pp":
            ax.add_patch(FancyArrowPatch((xa, ya - 0.42), (xb, yb + 0.42), arrowstyle="-|>",
                                         mutation_scale=7, color=COLORS["pp"], lw=lw, zorder=1))
        else:  # DP arcs under the row, CP arcs over it
            up = axis == "cp"
            ax.add_patch(FancyArrowPatch((xa, ya + (0.42 if up else -0.42)), (xb, yb + (0.42 if up else -0.42)),
                                         arrowstyle="-", connectionstyle=f"arc3,rad={-0.35 if up else 0.35}",
                                         color=COLORS[axis], lw=lw, linestyle="--" if axis == "dp" else ":",
                                         zorder=6))

    handles = [Patch(facecolor="white", edgecolor=COLORS["tp"], lw=2, label="TP group (all-reduce inside)"),
               Line2D([], [], color=COLORS["pp"], marker=">", label="PP send/recv (activations ↓, grads ↑)")]
    if grid.dp > 1:
        handles.append(Line2D([], [], color=COLORS["dp"], ls="--", label="DP: gradient all-reduce"))
    if grid.cp > 1:
        handles.append(Line2D([], [], color=COLORS["cp"], ls=":", lw=1.6, label="CP: K/V ring"))
    if highlight is not None:
        handles.append(Patch(facecolor=COLORS["self"], label=f"rank {highlight}"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 3),
              fontsize=8, frameon=False)
    ax.set_title(_title(grid, highlight), fontsize=9, loc="left")
    ax.set_xlim(-0.6, width + 0.6)
    ax.set_ylim(-(grid.pp - 1) * row_h - 1.2, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------

def save(obj, path, dpi: int = 150) -> Path:
    """Write a ``graphviz.Digraph`` (.svg/.png/.pdf/.dot) or a matplotlib ``Figure``
    (.svg/.png/.pdf) to ``path``, format from the suffix (``dpi`` for matplotlib PNGs).
    Output is reproducible: no dates in the metadata, fixed SVG ids. The file is written
    atomically (``safe_files``); whether ``path`` may be replaced is the caller's check."""
    from course_lib.safe_files import save_figure_atomic, write_atomic

    path = Path(path)
    suffix = path.suffix.lower()
    if hasattr(obj, "pipe") and hasattr(obj, "source"):  # graphviz
        if suffix not in FORMATS_GRAPHVIZ:
            raise UsageError(f"cannot write a Graphviz map as {suffix or 'no suffix'!r}; "
                             f"use one of {', '.join(FORMATS_GRAPHVIZ)}")
        return write_atomic(path, obj.source if suffix == ".dot" else obj.pipe(format=suffix[1:]))
    if suffix not in FORMATS_MATPLOTLIB:
        raise UsageError(f"cannot write a matplotlib figure as {suffix or 'no suffix'!r}; "
                         f"use one of {', '.join(FORMATS_MATPLOTLIB)}")
    import matplotlib

    metadata = {"svg": {"Date": None}, "png": {"Software": None}, "pdf": {"CreationDate": None}}[suffix[1:]]
    with matplotlib.rc_context({"svg.hashsalt": "course_lib", "svg.fonttype": "path"}):
        return save_figure_atomic(obj, path, format=suffix[1:], metadata=metadata,
                                  dpi=dpi if suffix == ".png" else None, bbox_inches="tight")
