"""Where pipeline and tensor parallelism cut a GPT: seed 000's hand-drawn picture.

``boundary_sketch(num_layers, tp, pp)`` -> matplotlib ``Figure``: Transformer blocks
stacked, PP cuts *between* blocks (stage, layer range, send/recv), TP cuts *inside*
blocks (QKV/FC1 column-split, proj/FC2 row-split, the one all-reduce after each
row-parallel GEMM), in xkcd style.

Which collective runs where follows Megatron-LM (Shoeybi et al. 2019, sec. 3;
``megatron/core/tensor_parallel/mappings.py``: f = identity forward / all-reduce
backward before the column-parallel GEMM, g = all-reduce forward / identity
backward after the row-parallel GEMM).
"""

from __future__ import annotations

import contextlib
import logging

from course_lib.topology.config import ParallelConfig
from course_lib.topology.rankmap import COLORS


@contextlib.contextmanager
def _sketch_style(xkcd: bool):
    import matplotlib.pyplot as plt

    if not xkcd:
        yield
        return
    logger = logging.getLogger("matplotlib.font_manager")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with plt.xkcd(scale=0.6, length=120, randomness=2):
            # xkcd's fonts are rarely installed: keep the wobble, use a font we have
            plt.rcParams["font.family"] = ["DejaVu Sans"]
            yield
    finally:
        logger.setLevel(level)


# Geometry (data units). A block's halves, attention | MLP: (name, x from, x to, its rows, how each row is split).
_HALVES = [("attention", 3.2, 6.7, ["QKV", "attention", "proj"], ["column", "local", "row"]),
           ("MLP", 7.1, 10.6, ["FC1", "GeLU", "FC2"], ["column", "local", "row"])]
_ROW_NAMES = ["column-split", "local", "row-split", "after row-split"]
_ROW_FILL = {"column": "#ffe9cc", "local": "#ffffff", "row": "#ffd9b3"}
_ROW_H = 0.55
_BLOCK_H = 4 * _ROW_H + _ROW_H
_CUT_H = 1.1
# The height of each kind of item in the vertical stack.
_HEIGHTS = {"embed": 0.9, "stage": 0.15, "block": _BLOCK_H + 0.45, "more": 0.6, "cut": _CUT_H, "head": 0.9}
_FS = 8.5  # font size


def _stack(ranges: list[range], blocks_per_stage: int) -> list[tuple[str, object]]:
    """The picture from top to bottom as ``(kind, payload)`` items: the embedding, then per stage its
    first (and last) layers, a "more" line for the layers not drawn and the PP cut below it, then the head."""
    items = [("embed", None)]
    for s, rng in enumerate(ranges):
        shown = list(rng) if len(rng) <= blocks_per_stage else \
            ([rng[0]] + ([rng[-1]] if blocks_per_stage > 1 else []))
        items.append(("stage", s))
        for i, layer in enumerate(shown):
            items.append(("block", (s, layer)))
            if i == 0 and len(rng) > len(shown):
                items.append(("more", len(rng) - len(shown)))
        if s < len(ranges) - 1:
            items.append(("cut", s))
    items.append(("head", None))
    return items


def _draw_end(ax, y: float, label: str) -> None:
    """The embedding on top or the LM head at the bottom: one grey box across the layer."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((1.9, y - 0.75), 8.6, 0.55, boxstyle="round,pad=0.02",
                                facecolor="#eeeeee", edgecolor="black"))
    ax.text(6.2, y - 0.47, label, ha="center", va="center", fontsize=_FS)


def _draw_more(ax, y: float, hidden: int) -> None:
    ax.text(6.2, y - 0.3, f"⋮  {hidden} more layer{'s' if hidden > 1 else ''} like these  ⋮",
            ha="center", va="center", fontsize=_FS, style="italic")


def _draw_cut(ax, y: float, s: int, above: range, below: range) -> None:
    """The PP cut between stage ``s`` (layers ``above``) and stage ``s + 1`` (layers ``below``)."""
    yc = y - _CUT_H / 2
    ax.plot([0.2, 13.6], [yc, yc], color=COLORS["self"], lw=2.2, ls="--")
    ax.text(0.25, yc + 0.12, f"PP cut: stage {s} (layers {above.start}–{above.stop - 1}) | "
            f"stage {s + 1} (layers {below.start}–{below.stop - 1})", fontsize=_FS, color=COLORS["self"],
            va="bottom")
    ax.text(0.25, yc - 0.12, "send activations [s, b, h] ↓ forward · send their gradients ↑ "
            "backward  (point-to-point in the pp group)", fontsize=_FS - 0.5, color=COLORS["self"],
            va="top")


def _draw_half(ax, top: float, tp: int, name: str, x0: float, x1: float, rows: list[str], kinds: list[str]) -> None:
    """One half of a layer (attention or MLP): its rows split over ``tp`` ranks, the all-reduce (g) after
    the row-parallel GEMM, and the vertical TP cuts."""
    from matplotlib.patches import Rectangle

    w = (x1 - x0) / tp
    ax.text((x0 + x1) / 2, top - 0.22, name, ha="center", va="center", fontsize=_FS - 0.5)
    if tp > 1:  # f: where the column-parallel input enters (identity fwd, all-reduce bwd)
        ax.text(x0 - 0.12, top - 0.45 - _ROW_H + _ROW_H * 0.45, "f", ha="center", va="center",
                fontsize=_FS - 1.5, color=COLORS["self"],
                bbox=dict(boxstyle="circle,pad=0.15", fc="white", ec=COLORS["self"], lw=0.8))
    for i, (lab, kd) in enumerate(zip(rows, kinds)):
        yr = top - 0.45 - (i + 1) * _ROW_H
        for k in range(tp):
            ax.add_patch(Rectangle((x0 + k * w, yr), w, _ROW_H * 0.9, facecolor=_ROW_FILL[kd],
                                   edgecolor="#999999", lw=0.6))
            if tp <= 4:
                ax.text(x0 + (k + 0.5) * w, yr + _ROW_H * 0.45, f"{lab}·{k}" if tp > 1 else lab,
                        ha="center", va="center", fontsize=_FS - 1.5)
        if tp > 4:  # too narrow for per-shard names: one label over the row
            ax.text((x0 + x1) / 2, yr + _ROW_H * 0.45, f"{lab} ({tp} shards)", ha="center",
                    va="center", fontsize=_FS - 1.5, zorder=5,
                    bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.85))
    # the all-reduce (g) after the row-parallel GEMM
    yr = top - 0.45 - 4 * _ROW_H
    ax.add_patch(Rectangle((x0, yr), x1 - x0, _ROW_H * 0.9, facecolor="#fde0e0",
                           edgecolor=COLORS["self"], lw=1.0))
    ax.text((x0 + x1) / 2, yr + _ROW_H * 0.45, "⊕ all-reduce (g) over TP" if tp > 1 else
            "+ residual", ha="center", va="center", fontsize=_FS - 1, color=COLORS["self"])
    # vertical TP cuts through the split rows, stopping at the all-reduce
    for k in range(1, tp):
        xk = x0 + k * w
        ax.plot([xk, xk], [top - 0.4, yr + _ROW_H * 0.95], color=COLORS["tp"], lw=1.8, ls="--")


def _draw_block_notes(ax, top: float, tp: int) -> None:
    """The notes beside the first layer drawn: what each split costs, and what f and g do."""
    ax.text(10.9, top - 0.45 - 1 * _ROW_H + 0.25, "column split: each TP rank owns\n"
            "whole heads / FFN columns: no comm", fontsize=_FS - 1, va="center", color="#7a4a00")
    ax.text(10.9, top - 0.45 - 3 * _ROW_H + 0.25, "row split: input already split,\n"
            "output = partial sums", fontsize=_FS - 1, va="center", color="#7a4a00")
    ax.text(10.9, top - 0.45 - 4 * _ROW_H + 0.25, "the only forward comm: 2 all-reduces\n"
            "per layer (2 more backward, by f)", fontsize=_FS - 1, va="center",
            color=COLORS["self"])
    ax.text(10.9, top - 0.22, "(f): identity forward,\nall-reduce backward", fontsize=_FS - 1,
            va="center", color=COLORS["self"])
    ax.text((_HALVES[0][1] + _HALVES[0][2]) / 2, top - _BLOCK_H - 0.15,
            f"TP cuts (orange, vertical): {tp} shards", ha="center", va="top", fontsize=_FS - 1,
            color=COLORS["tp"])


def _draw_block(ax, top: float, layer: int, tp: int, notes: bool) -> None:
    """Transformer layer ``layer`` with its top at ``top``: both halves split over ``tp`` ranks
    (``notes``: with the notes beside it)."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((1.6, top - _BLOCK_H), 9.15, _BLOCK_H - 0.05,
                                boxstyle="round,pad=0.04", facecolor="#fbfbf4", edgecolor="black",
                                lw=1.2))
    ax.text(1.7, top - 0.22, f"Transformer layer {layer}", fontsize=_FS, va="center",
            fontweight="bold")
    for i, rn in enumerate(_ROW_NAMES):
        ax.text(1.75, top - 0.45 - (i + 1) * _ROW_H + _ROW_H * 0.45, rn, fontsize=_FS - 1.5,
                va="center", color="#555555", style="italic")
    for half in _HALVES:
        _draw_half(ax, top, tp, *half)
    if notes and tp > 1:
        _draw_block_notes(ax, top, tp)


def _draw_stage_labels(ax, stage_top: dict[int, float], bottom_y: float, ranges: list[range]) -> None:
    """Stage labels down the left edge, each from its stage's top to the cut below it (the last: to the head)."""
    from matplotlib.patches import Rectangle

    bounds = sorted(stage_top.items())
    for i, (s, top) in enumerate(bounds):
        bottom = bounds[i + 1][1] + _CUT_H if i + 1 < len(bounds) else bottom_y + _HEIGHTS["head"]
        r = ranges[s]
        ax.add_patch(Rectangle((0.2, bottom + 0.1), 1.1, top - bottom - 0.25, facecolor="#eaf2fb",
                               edgecolor=COLORS["pp"], lw=1.0))
        ax.text(0.75, (top + bottom) / 2, f"stage {s}\nlayers {r.start}–{r.stop - 1}", rotation=90,
                ha="center", va="center", fontsize=_FS, color=COLORS["pp"])


def boundary_sketch(num_layers: int = 8, tp: int = 2, pp: int = 2, *, config: ParallelConfig | None = None,
                    blocks_per_stage: int | None = None, xkcd: bool = True):
    """Where pipeline and tensor parallelism cut a GPT (seed 000's hand-drawn picture).

    The model is a stack of Transformer layers, stage 0 on top. PP cuts run
    *between* layers (horizontal, red): each is labelled with the stages, their
    layer ranges and the send/recv of activations [s, b, h] (forward) and their
    gradients (backward). TP cuts run *inside* each layer (vertical, orange): QKV
    and FC1 are column-split (whole heads / FFN columns per rank, no
    communication), proj and FC2 are row-split (their input is already split) and
    are followed by the layer's only forward communication, an all-reduce (g).
    Give ``config`` (a ``ParallelConfig``) for an explicit uneven layer split.
    Returns the ``Figure``.
    """
    import matplotlib.pyplot as plt

    if config is None:
        config = ParallelConfig(tp * pp, tp=tp, pp=pp, num_layers=num_layers)
    tp, pp = config.tp, config.pp
    ranges = config.layer_ranges()
    if blocks_per_stage is None:
        blocks_per_stage = 2 if pp <= 2 else 1
    items = _stack(ranges, blocks_per_stage)
    total = sum(_HEIGHTS[k] for k, _ in items)

    with _sketch_style(xkcd):
        fig, ax = plt.subplots(figsize=(11.5, max(5.0, 0.62 * total + 1.0)))
        y = 0.0
        stage_top = {}
        first_block = True
        for kind, payload in items:
            if kind == "embed":
                _draw_end(ax, y, "word embedding (vocab split over TP) + position embedding")
            elif kind == "head":
                _draw_end(ax, y, "LM head + loss (vocab-parallel; tied weights → embedding-group "
                          "all-reduce with stage 0)" if pp > 1 else "LM head + loss (vocab-parallel)")
            elif kind == "stage":
                stage_top[payload] = y
            elif kind == "more":
                _draw_more(ax, y, payload)
            elif kind == "cut":
                _draw_cut(ax, y, payload, ranges[payload], ranges[payload + 1])
            elif kind == "block":
                _draw_block(ax, y, payload[1], tp, notes=first_block)
                first_block = False
            y -= _HEIGHTS[kind]
        _draw_stage_labels(ax, stage_top, y, ranges)
        ax.set_xlim(0, 13.8)
        ax.set_ylim(y - 0.1, 0.3)
        ax.axis("off")
        ax.set_title(f"Where PP and TP cut a {config.num_layers}-layer GPT: TP={tp} (inside layers), "
                     f"PP={pp} (between layers)", fontsize=11)
        fig.tight_layout()
    return fig
