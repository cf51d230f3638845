"""The seed configurations' rank maps and the hand-drawn TP/PP boundary picture.

``write_figures(out_dir)`` writes, for each seed layout, the Graphviz map (SVG)
and the matplotlib map (PNG), plus the boundary sketch -- all from the tested
functions in :mod:`course_lib.topology.rankmap` and :mod:`course_lib.topology.boundaries`.
``python -m course_lib.topology.figures`` (or ``main()``) writes them into ``figures/``.

Seed layouts: 8 = TP2 x PP2 x DP2 (seed 003); 32 GPUs as TP16 x PP2 and as
TP4 x PP8 (seed 000); 128 = TP4 x PP4 x DP8 with 72 layers (seed 001);
8 = TP2 x PP2 x CP2 (seed 003, config F).
"""

from __future__ import annotations

from pathlib import Path

# name -> (RankGrid kwargs, num_layers, rank to highlight)
SEED_LAYOUTS = {
    "rankmap_8_tp2_pp2_dp2": (dict(world_size=8, tp=2, pp=2), 8, 5),
    "rankmap_32_tp16_pp2": (dict(world_size=32, tp=16, pp=2), None, None),
    "rankmap_32_tp4_pp8": (dict(world_size=32, tp=4, pp=8), None, None),
    "rankmap_128_tp4_pp4_dp8": (dict(world_size=128, tp=4, pp=4), 72, 37),
    "rankmap_8_tp2_pp2_cp2": (dict(world_size=8, tp=2, pp=2, cp=2), 8, 5),
}


def write_figures(out_dir) -> list[Path]:
    """Write every topology figure into ``out_dir``; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.topology.boundaries import boundary_sketch
    from course_lib.topology.grid import RankGrid
    from course_lib.topology.rankmap import rank_map, rank_map_figure, save

    out_dir = Path(out_dir)
    written = []
    for name, (kwargs, layers, highlight) in SEED_LAYOUTS.items():
        grid = RankGrid(**kwargs)
        written.append(save(rank_map(grid, highlight=highlight, num_layers=layers),
                                     out_dir / f"{name}.svg"))
        fig = rank_map_figure(grid, highlight=highlight, num_layers=layers)
        written.append(save(fig, out_dir / f"{name}.png"))
        plt.close(fig)
    for name, (layers, tp, pp) in {"tp_pp_boundaries_8layers_tp2_pp2": (8, 2, 2),
                                   "tp_pp_boundaries_72layers_tp4_pp4": (72, 4, 4)}.items():
        fig = boundary_sketch(layers, tp, pp)
        written.append(save(fig, out_dir / f"{name}.png", dpi=100))
        plt.close(fig)
    return written


def main(out_dir="figures") -> list[Path]:
    paths = write_figures(out_dir)
    for p in paths:
        print(f"wrote {p}")
    return paths


if __name__ == "__main__":
    main()
