"""Pictures of sharded state: what each rank holds during one ZeRO-1 step (Lab 07's theory).

:func:`plot_zero1_step` draws the four moments of Megatron's distributed optimizer step
(``megatron/core/optimizer/distrib_optimizer.py``; ZeRO stage 1, Rajbhandari et al. 2020 §5.1) on
``d`` ranks: every rank's own full gradient buffer, the reduce-scatter that leaves rank ``r`` the
sum of shard ``r``, the optimizer step on that shard alone (its fp32 main copy and Adam's two
moments: the only optimizer state the rank keeps), and the all-gather of the updated shards.
:func:`write_figures` writes it into ``figures/`` (``python -m course_lib figures``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_zero1_step", "write_figures"]

_PANELS = ("1. backward: every rank has\nits own gradients for all N",
           "2. reduce-scatter: rank r receives\nthe sum of shard r (then / d)",
           "3. Adam on shard r only: fp32 main\nparams + 2 moments for N/d",
           "4. all-gather: every rank has\nall N updated parameters")


def plot_zero1_step(d: int = 4, ax=None):
    """``d`` ranks (rows) x the four moments of one ZeRO-1 step (panels); each buffer of N elements drawn as
    ``d`` shards, coloured by shard, hatched where a rank holds only its own contribution. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(12, 0.55 * d + 1.5))
    colors = plt.get_cmap("tab10").colors
    width, gap = 1.0, 0.6
    for panel, title in enumerate(_PANELS):
        x0 = panel * (width + gap)
        ax.text(x0 + width / 2, d + 0.05, title, ha="center", va="bottom", fontsize=8)
        for r in range(d):
            y = d - 1 - r
            for s in range(d):
                held = panel in (0, 3) or s == r
                left = x0 + s * width / d
                if panel == 2 and s == r:       # the shard's fp32 main copy and its two moments, stacked
                    for k, label in enumerate(("p", "m", "v")):
                        ax.add_patch(Rectangle((left, y + 0.1 + k * 0.27), width / d, 0.25, facecolor=colors[s],
                                               edgecolor="black", linewidth=0.5, alpha=1.0 - 0.25 * k))
                        ax.text(left + width / (2 * d), y + 0.22 + k * 0.27, label, ha="center", va="center",
                                fontsize=6)
                    continue
                ax.add_patch(Rectangle((left, y + 0.15), width / d, 0.7,
                                       facecolor=colors[s] if held else "white", edgecolor="black", linewidth=0.5,
                                       hatch="//" if panel == 0 else None, alpha=0.55 if panel == 0 else 1.0))
            if panel == 0:
                ax.text(x0 - 0.05, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=8)
        if panel < len(_PANELS) - 1:
            ax.annotate("", xy=(x0 + width + gap * 0.85, d / 2), xytext=(x0 + width + gap * 0.15, d / 2),
                        arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(-0.45, len(_PANELS) * (width + gap))
    ax.set_ylim(-0.3, d + 0.8)
    ax.axis("off")
    ax.set_title(f"One ZeRO-1 step on {d} data-parallel ranks: one reduce-scatter and one all-gather (the bytes of "
                 f"one all-reduce), 1/{d} of the optimizer state per rank", fontsize=9)
    return ax.figure


def write_figures(out_dir) -> list[Path]:
    """``zero1_step_4_ranks.png`` (Lab 07, before its step on real ranks)."""
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.safe_files import save_and_close_figure

    return [save_and_close_figure(plot_zero1_step(4), Path(out_dir) / "zero1_step_4_ranks.png")]
