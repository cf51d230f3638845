"""``python -m course_lib rankmap``: print or draw Megatron's rank grid.

    python -m course_lib rankmap --world-size 8 --tp 2 --pp 2
    python -m course_lib rankmap --world-size 8 --tp 2 --pp 2 --highlight 5 --out rankmap.svg
    python -m course_lib rankmap --world-size 128 --tp 4 --pp 4 --num-layers 72 --out map.png

Without ``--out`` it prints the groups (and each rank's coordinates) as text.
With ``--out`` the format comes from the suffix: .svg / .png / .pdf via Graphviz
(``dot`` must be installed; ``--engine matplotlib`` draws without it), .dot
writes the Graphviz source. A bad configuration raises ValueError, which the
CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from course_lib.topology import DEFAULT_ORDER, ParallelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Print or draw the Megatron-LM rank grid (TP x CP x DP x PP) and its process groups."
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-model-parallel size (default 1)")
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1,
                        help="pipeline-model-parallel size (default 1)")
    parser.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
                        help="context-parallel size (default 1); DP is derived: world / (tp*pp*cp)")
    parser.add_argument("--order", default=DEFAULT_ORDER,
                        help=f"rank order, first axis fastest (default {DEFAULT_ORDER}, Megatron's)")
    parser.add_argument("--num-layers", type=int, default=None, help="label each stage with its layer range")
    parser.add_argument("--num-attention-heads", type=int, default=None, help="also check heads %% tp == 0")
    parser.add_argument("--highlight", type=int, default=None, metavar="RANK",
                        help="colour this rank's TP/CP/DP/PP groups")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="write a picture: .svg, .png, .pdf or .dot (default: print text)")
    parser.add_argument("--engine", choices=("graphviz", "matplotlib"), default="graphviz",
                        help="drawing engine for --out (default graphviz)")


def run(args: argparse.Namespace) -> int:
    config = ParallelConfig(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, num_layers=args.num_layers,
                            num_attention_heads=args.num_attention_heads, order=args.order)
    grid = config.grid
    if args.highlight is not None:
        grid.coords(args.highlight)  # validates the rank: one-line ValueError
    if args.out is None:
        print(config.summary())
        print(grid.table())
        if args.highlight is not None:
            print(f"rank {args.highlight}: coords {grid.coords(args.highlight)}")
            for token, group in grid.groups_of(args.highlight).items():
                print(f"  {token:<10} {group}")
        if grid.world_size <= 128:
            print(grid.coords_table())
        else:
            print(f"(per-rank coordinates omitted for {grid.world_size} ranks)")
        return 0

    from course_lib import diagrams

    out = Path(args.out)
    suffix = out.suffix.lower()
    if args.engine == "matplotlib":
        if suffix not in diagrams.FORMATS_MATPLOTLIB:
            raise ValueError(f"--out {args.out}: matplotlib writes {', '.join(diagrams.FORMATS_MATPLOTLIB)}; "
                             f"change the suffix")
        import matplotlib

        matplotlib.use("Agg")
        fig = diagrams.rank_map_figure(grid, highlight=args.highlight, num_layers=args.num_layers)
        diagrams.save(fig, out)
    else:
        if suffix not in diagrams.FORMATS_GRAPHVIZ:
            raise ValueError(f"--out {args.out}: use a .svg, .png, .pdf or .dot file name")
        import graphviz

        dot = diagrams.rank_map(grid, highlight=args.highlight, num_layers=args.num_layers)
        try:
            diagrams.save(dot, out)
        except graphviz.ExecutableNotFound:
            raise ValueError("Graphviz's 'dot' program is not installed; install graphviz, or use "
                             "--out NAME.dot, or --engine matplotlib") from None
    print(f"wrote {out} ({grid!r})", file=sys.stderr)
    return 0
