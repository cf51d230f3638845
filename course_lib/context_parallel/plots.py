"""Pictures of the ring: which rank holds which K/V chunk at each step, and which blocks it computes.

Drawn from :func:`~course_lib.context_parallel.schedule.ring_schedule` -- the same
schedule :func:`~course_lib.context_parallel.ring.ring_attention` executes.
"""

from __future__ import annotations

import math

from course_lib.context_parallel.schedule import CAUSAL, ring_schedule
from course_lib.context_parallel.zigzag import num_chunks

__all__ = ["plot_ring_steps"]


def _colors(cp: int):
    import matplotlib.pyplot as plt
    import numpy as np

    if cp <= 10:
        return list(plt.get_cmap("tab10").colors[:cp])
    return list(plt.get_cmap("viridis")(np.linspace(0, 1, cp)))


def _chunks(ids) -> str:
    return ",".join(f"c{k}" for k in ids)


def plot_ring_steps(cp_size: int = 4, layout: str = "zigzag", causal: bool = True, direction: str = "fwd",
                    show_blocks: bool = True):
    """One column per ring step: top, the ring (rank r's queries and the K/V chunks it holds, arrows =
    the transfer after the step); bottom (``show_blocks``), the chunk-level attention matrix with the
    blocks computed at this step coloured by rank (earlier steps grey, causal diagonals as triangles).

    ``direction="bwd"`` draws the reverse ring of the backward pass (K/V and dK/dV move to rank r−1).
    Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle, FancyArrowPatch, Polygon, Rectangle

    sched = ring_schedule(cp_size, layout, causal, direction)
    cp = cp_size
    colors = _colors(cp)
    rows = 2 if show_blocks else 1
    fig, axes = plt.subplots(rows, cp, figsize=(3.3 * cp, 3.4 * rows), squeeze=False)
    radius = 1.0
    pos = [(radius * math.sin(2 * math.pi * r / cp), radius * math.cos(2 * math.pi * r / cp)) for r in range(cp)]
    moving = "K,V" if direction == "fwd" else "K,V,dK,dV"
    n = num_chunks(cp, layout)
    done: list[tuple[int, int, str]] = []
    for step, row in enumerate(sched):
        ax = axes[0][step]
        ax.set_xlim(-1.9, 1.9)
        ax.set_ylim(-1.9, 1.9)
        ax.set_aspect("equal")
        ax.axis("off")
        if step < cp - 1 and cp > 1:
            note = f"then {moving} move to rank r{'+' if direction == 'fwd' else '-'}1"
        else:
            note = "last step: no transfer"
        ax.set_title(f"{direction} step {step}\n{note}", fontsize=9)
        for r, cell in enumerate(row):
            x, y = pos[r]
            ax.add_patch(Circle((x, y), 0.3, facecolor=colors[r], edgecolor="black", alpha=0.9))
            ax.text(x, y, f"r{r}", ha="center", va="center", fontsize=9, color="white", weight="bold")
            lx, ly = 1.55 * x, 1.55 * y
            ax.text(lx, ly, f"Q {_chunks(cell['q_chunks'])}\nKV {_chunks(cell['kv_chunks'])}", ha="center",
                    va="center", fontsize=7.5,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor=colors[cell["kv_rank"]]))
            if cell["sends_to"] is not None and cp > 1:
                tx, ty = pos[cell["sends_to"]]
                ax.add_patch(FancyArrowPatch((x, y), (tx, ty), arrowstyle="-|>", mutation_scale=12,
                                             shrinkA=14, shrinkB=14, color="black", lw=1,
                                             connectionstyle="arc3,rad=0.25"))
        if not show_blocks:
            continue
        bx = axes[1][step]
        bx.set_xlim(0, n)
        bx.set_ylim(n, 0)
        bx.set_aspect("equal")
        bx.set_xticks([k + 0.5 for k in range(n)], [f"c{k}" for k in range(n)], fontsize=7)
        bx.set_yticks([k + 0.5 for k in range(n)], [f"c{k}" for k in range(n)], fontsize=7)
        bx.set_xlabel("K/V chunk", fontsize=8)
        if step == 0:
            bx.set_ylabel("query chunk", fontsize=8)
        bx.tick_params(length=0)

        def draw(qc, kc, kind, **style):
            if kind == CAUSAL:
                bx.add_patch(Polygon([(kc, qc), (kc, qc + 1), (kc + 1, qc + 1)], closed=True, **style))
            else:
                bx.add_patch(Rectangle((kc, qc), 1, 1, **style))

        for qc, kc, kind in done:
            draw(qc, kc, kind, facecolor="0.85", edgecolor="white")
        for r, cell in enumerate(row):
            for blk in cell["blocks"]:
                draw(blk.q_chunk, blk.kv_chunk, blk.kind, facecolor=colors[r], edgecolor="white")
                done.append((blk.q_chunk, blk.kv_chunk, blk.kind))
        for k in range(n + 1):
            bx.axhline(k, color="0.7", lw=0.4)
            bx.axvline(k, color="0.7", lw=0.4)
        counts = [len(cell["blocks"]) for cell in row]
        bx.set_title("blocks per rank: " + " ".join(str(c) for c in counts), fontsize=8)
    fig.suptitle(f"ring attention, cp={cp}, {layout} split, {'causal' if causal else 'no mask'} "
                 f"({'forward' if direction == 'fwd' else 'backward: reverse ring'})", fontsize=11)
    fig.tight_layout()
    return fig
