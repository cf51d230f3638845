"""Per-rank attention work under context parallelism: why Megatron splits causal sequences zigzag.

The work of attention is proportional to the number of *unmasked* score
elements ``q·k`` a rank computes. Without a mask every query sees every key and
each of ``cp`` ranks computes ``s²/cp``. With a causal mask query ``p`` (0-based
global position) sees ``p + 1`` keys, so the split decides the balance:

* contiguous, chunk ``c = s/cp``, rank r holds positions ``rc .. rc+c−1``:
  ``Σ (p+1) = c²·r + c(c+1)/2`` -- grows with r: the last rank does about
  ``2cp−1`` times the first's work (about 2× the mean), and the ring waits for it.
* zigzag, chunk ``c = s/(2cp)``, rank r holds chunks r and ``2cp−1−r``:
  ``c²·(2cp−1) + c(c+1)`` -- the same on every rank.

Both sum to ``s(s+1)/2``. :func:`score_elements` counts by enumerating the
positions each rank holds; :func:`score_elements_closed_form` is the formula above;
:func:`ring_step_work` counts the blocks the ring (:mod:`.schedule`) really
computes per step, whose per-step maximum over ranks (:func:`critical_path`) is
what a synchronous ring waits for.
"""

from __future__ import annotations

from course_lib.context_parallel.schedule import CAUSAL, ring_schedule
from course_lib.context_parallel.zigzag import _check_cp, check_sequence_split, num_chunks, token_positions
from course_lib.rules import UsageError

__all__ = ["score_elements", "score_elements_closed_form", "block_elements", "ring_step_work", "critical_path",
           "imbalance", "plot_attention_work"]


def score_elements(seq_length: int, cp_size: int, layout: str = "zigzag", causal: bool = True) -> list[int]:
    """Unmasked score elements per rank, counted from the positions each rank holds."""
    check_sequence_split(seq_length, cp_size, layout)
    return [sum((p + 1) if causal else seq_length for p in token_positions(r, cp_size, seq_length, layout))
            for r in range(cp_size)]


def score_elements_closed_form(seq_length: int, cp_size: int, layout: str = "zigzag",
                               causal: bool = True) -> list[int]:
    """The same counts from the closed forms in the module docstring."""
    c = check_sequence_split(seq_length, cp_size, layout)
    if not causal:
        return [seq_length * seq_length // cp_size] * cp_size
    if layout == "contiguous":
        return [c * c * r + c * (c + 1) // 2 for r in range(cp_size)]
    return [c * c * (2 * cp_size - 1) + c * (c + 1)] * cp_size


def block_elements(kind: str, chunk: int) -> int:
    """Score elements of one chunk×chunk block: ``c²`` (full) or ``c(c+1)/2`` (diagonal, causal)."""
    return chunk * (chunk + 1) // 2 if kind == CAUSAL else chunk * chunk


def ring_step_work(seq_length: int, cp_size: int, layout: str = "zigzag", causal: bool = True,
                   unit: str = "elements") -> list[list[int]]:
    """``work[step][rank]`` of the forward ring: unmasked score elements (``unit="elements"``)
    or the number of chunk blocks computed (``unit="blocks"``)."""
    if unit not in ("elements", "blocks"):
        raise UsageError(f"unit={unit!r} must be 'elements' or 'blocks'")
    c = check_sequence_split(seq_length, cp_size, layout)
    sched = ring_schedule(cp_size, layout, causal, "fwd")
    if unit == "blocks":
        return [[len(cell["blocks"]) for cell in row] for row in sched]
    return [[sum(block_elements(b.kind, c) for b in cell["blocks"]) for cell in row] for row in sched]


def critical_path(seq_length: int, cp_size: int, layout: str = "zigzag", causal: bool = True) -> int:
    """Σ over ring steps of the busiest rank's score elements: the ring's compute time in element units
    (each step ends when the slowest rank has its next K/V)."""
    return sum(max(row) for row in ring_step_work(seq_length, cp_size, layout, causal))


def imbalance(work: list[int]) -> float:
    """``max / mean`` of per-rank work (1.0 = perfectly balanced)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def plot_attention_work(seq_length: int = 64, cp_size: int = 4, causal: bool = True):
    """Figure: who computes which causal score (contiguous vs zigzag) and the per-rank work bars.

    Left two panels: the ``s × s`` score matrix, each unmasked element coloured by the
    rank that owns its query; right: unmasked elements per rank for both splits."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    _check_cp(cp_size)
    check_sequence_split(seq_length, cp_size, "zigzag")
    colors = plt.get_cmap("tab10").colors[:cp_size] if cp_size <= 10 else plt.get_cmap("viridis")(
        np.linspace(0, 1, cp_size))
    cmap = ListedColormap(list(colors))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1, 1.3]})
    for ax, layout in zip(axes[:2], ("contiguous", "zigzag")):
        owner = np.zeros(seq_length, dtype=float)
        for r in range(cp_size):
            owner[token_positions(r, cp_size, seq_length, layout)] = r
        grid = np.repeat(owner[:, None], seq_length, axis=1)
        if causal:
            grid = np.where(np.tri(seq_length, dtype=bool), grid, np.nan)
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=cp_size - 0.5, interpolation="nearest")
        n = num_chunks(cp_size, layout)
        for k in range(1, n):
            ax.axhline(k * seq_length / n - 0.5, color="white", lw=0.8)
        ax.set_title(f"{layout}: query rows by rank")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    x = np.arange(cp_size)
    for off, layout in ((-0.2, "contiguous"), (0.2, "zigzag")):
        w = score_elements(seq_length, cp_size, layout, causal)
        axes[2].bar(x + off, w, width=0.4, label=f"{layout} (max/mean {imbalance(w):.2f})",
                    color="tab:gray" if layout == "contiguous" else "tab:blue", edgecolor="black")
    axes[2].set_xticks(x, [f"rank {r}" for r in range(cp_size)])
    axes[2].set_ylabel("unmasked score elements")
    axes[2].set_title(f"work per rank, s={seq_length}, cp={cp_size}" + (", causal" if causal else ""))
    axes[2].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig

