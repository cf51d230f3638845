"""Drawings of the column and row splits: which block of X, A and Y each rank holds.

``Y = X A`` in the math orientation of the Megatron paper (A is ``[in, out]``;
nn.Linear stores its transpose ``[out, in]``). Colours are ranks; grey means
"the same full tensor on every rank".
"""

from __future__ import annotations
from course_lib.rules import UsageError

__all__ = ["plot_linear_splits", "RANK_COLORS"]

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
_GREY = "#D0D0D0"


def _box(ax, x, y, w, h, color, label=None, fontsize=8):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.8))
    if label:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize)


def plot_linear_splits(tp: int = 2):
    """Two panels: column-parallel (A split by columns, output stays split, no communication)
    and row-parallel (A split by rows, X split the same way, partial sums all-reduced).
    Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    if not 1 <= tp <= len(RANK_COLORS):
        raise UsageError(f"tp={tp} must be between 1 and {len(RANK_COLORS)} for this drawing")
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.6))
    S, IN, OUT = 2.0, 2.4, 2.4      # drawn sizes of tokens, in-features, out-features
    xa, xy = IN + 1.2, IN + OUT + 2.4  # left edges of A and of the result

    def between(ax, x, sym):
        ax.text(x, S / 2, sym, fontsize=16, va="center", ha="center")

    # ---- column parallel: X (grey) x [A_1 .. A_t] = [Y_1 .. Y_t]
    ax = axes[0]
    _box(ax, 0, 0, IN, S, _GREY, "X\n[s·b, in]\nevery rank")
    between(ax, IN + 0.6, "×")
    for i in range(tp):
        w = OUT / tp
        _box(ax, xa + i * w, -0.2, w, IN, RANK_COLORS[i], f"A{i + 1}" if tp <= 4 else "")
        _box(ax, xy + i * w, 0, w, S, RANK_COLORS[i], f"Y{i + 1}" if tp <= 4 else "")
    ax.text(xa + OUT / 2, -0.45, f"A split by columns:\nrank i holds [in, out/{tp}]",
            ha="center", va="top", fontsize=8)
    between(ax, xa + OUT + 0.6, "=")
    ax.text(xy + OUT + 0.3, S / 2, f"Y_i = X A_i on rank i: [s·b, out/{tp}]\n"
            "stays split: no communication\n(all-gather only if gather_output=True)", va="center", fontsize=8)
    ax.set_title("ColumnParallelLinear (forward): f = identity before, nothing after", fontsize=10, loc="left")

    # ---- row parallel: [X_1 .. X_t] x [A_1; ..; A_t] = sum_i X_i A_i
    ax = axes[1]
    for i in range(tp):
        w = IN / tp
        _box(ax, i * w, 0, w, S, RANK_COLORS[i], f"X{i + 1}" if tp <= 4 else "")
        h = IN / tp
        _box(ax, xa, -0.2 + IN - (i + 1) * h, OUT, h, RANK_COLORS[i], f"A{i + 1}" if tp <= 4 else "")
    ax.text(IN / 2, -0.45, "X split by columns\n(input_is_parallel)", ha="center", va="top", fontsize=8)
    between(ax, IN + 0.6, "×")
    ax.text(xa + OUT / 2, -0.45, f"A split by rows:\nrank i holds [in/{tp}, out]", ha="center", va="top",
            fontsize=8)
    between(ax, xa + OUT + 0.6, "=")
    pw = OUT * 0.8
    for i in reversed(range(tp)):
        off = 0.12 * i
        _box(ax, xy + off, -off, pw, S, RANK_COLORS[i], "X_i A_i" if i == 0 else None)
    ax.text(xy + pw / 2, -0.45 - 0.12 * (tp - 1), "partial sums,\nfull size, every rank", ha="center",
            va="top", fontsize=8)
    ax.annotate("", xy=(xy + pw + 1.9, S / 2), xytext=(xy + pw + 0.5, S / 2), arrowprops=dict(arrowstyle="->"))
    ax.text(xy + pw + 1.2, S / 2 + 0.15, "g: all-reduce", ha="center", va="bottom", fontsize=8)
    _box(ax, xy + pw + 2.0, 0, pw, S, _GREY, "Y\nevery rank")
    ax.set_title("RowParallelLinear (forward): one all-reduce after the GEMM", fontsize=10, loc="left")

    for ax in axes:
        ax.set_xlim(-0.3, xy + 2 * pw + 2.3)
        ax.set_ylim(-1.6, IN + 0.3)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig
