"""``python -m course_lib rankmap``: print or draw Megatron's rank grid.

    python -m course_lib rankmap --world-size 8 --tp 2 --pp 2
    python -m course_lib rankmap --world-size 8 --tp 2 --pp 2 --highlight 5 --out rankmap.svg
    python -m course_lib rankmap --world-size 128 --tp 4 --pp 4 --num-layers 72 --out map.png

Without ``--out`` it prints the groups (and each rank's coordinates) as text.
With ``--out`` the format comes from the suffix: .svg / .png / .pdf via Graphviz
(``dot`` must be installed; ``--engine matplotlib`` draws without it), .dot
writes the Graphviz source. A bad configuration raises ValueError, which the
CLI prints as one line with exit code 2.

Limits, checked before anything is built: the text tables go up to
``TABLE_MAX_RANKS`` ranks and the drawings up to ``DRAW_MAX_RANKS`` (beyond that a
picture is unreadable and the tables' memory, which grows with the world size, is
wasted: the grid repeats the same pattern at any scale). ``--out`` never replaces an
existing file without ``--force``, and is written atomically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from course_lib.safe_files import check_output_file
from course_lib.topology import rankmap
from course_lib.topology.config import ParallelConfig
from course_lib.topology.grid import DEFAULT_ORDER, RankGrid
from course_lib.rules import UsageError

TABLE_MAX_RANKS = 1 << 20  # 1,048,576 ranks: ~100 MB for the group tables
DRAW_MAX_RANKS = 1024      # a map of more ranks is unreadable (and takes minutes with matplotlib)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Print or draw the Megatron-LM rank grid (TP x CP x DP x PP) and its process groups."
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-model-parallel size (default 1)")
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1,
                        help="pipeline-model-parallel size (default 1)")
    parser.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
                        help="context-parallel size (default 1); DP is derived: world / (tp*pp*cp)")
    parser.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1,
                        help="expert-model-parallel size (default 1): adds the expert grid (MoE layers); "
                             "the dense DP is unchanged")
    parser.add_argument("--expert-tp", "--expert-tensor-parallel-size", dest="expert_tp", type=int, default=None,
                        help="expert tensor-parallel size (default: --tp)")
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
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")


def check_size(world_size: int, drawing: bool) -> None:
    """Refuse a world too large to tabulate or draw (one line naming the limit)."""
    if drawing and world_size > DRAW_MAX_RANKS:
        raise UsageError(f"--world-size {world_size}: rankmap draws at most {DRAW_MAX_RANKS} ranks; drop --out to "
                         f"print the tables (up to {TABLE_MAX_RANKS} ranks), or draw a smaller world with the same "
                         f"--tp/--pp/--cp")
    if world_size > TABLE_MAX_RANKS:
        raise UsageError(f"--world-size {world_size}: rankmap prints tables for at most {TABLE_MAX_RANKS} ranks; "
                         f"the grid repeats the same pattern at any scale, so try a smaller world with the same "
                         f"--tp/--pp/--cp")


def _check_out(args: argparse.Namespace) -> Path:
    """The ``--out`` path: a suffix the engine writes, and a file that may be written (before any work)."""
    out = Path(args.out)
    suffix = out.suffix.lower()
    if args.engine == "matplotlib" and suffix not in rankmap.FORMATS_MATPLOTLIB:
        raise UsageError(f"--out {args.out}: matplotlib writes {', '.join(rankmap.FORMATS_MATPLOTLIB)}; "
                         f"change the suffix")
    if args.engine == "graphviz" and suffix not in rankmap.FORMATS_GRAPHVIZ:
        raise UsageError(f"--out {args.out}: use a .svg, .png, .pdf or .dot file name")
    return check_output_file(out, force=args.force, what="--out")


def run(args: argparse.Namespace) -> int:
    if isinstance(args.world_size, int):  # anything else: ParallelConfig's one-line error
        check_size(args.world_size, drawing=args.out is not None)
    out = _check_out(args) if args.out is not None else None
    config = ParallelConfig(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, num_layers=args.num_layers,
                            num_attention_heads=args.num_attention_heads, order=args.order)
    grid = config.grid
    if args.ep > 1 or args.expert_tp is not None:  # the expert grid too (Megatron's MoE parallel folding)
        grid = RankGrid(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                        expert_tp=args.expert_tp, order=args.order)
    if args.highlight is not None:
        grid.coords(args.highlight)  # validates the rank: one-line ValueError
    if out is None:
        print(config.summary())
        print(grid.table())
        if args.highlight is not None:
            print(f"rank {args.highlight}: coords {grid.coords(args.highlight)}")
            for token, group in grid.groups_of(args.highlight).items():
                print(f"  {token:<10} {group}")
            if grid.ep > 1:
                for token in ("ep", "tp", "dp"):
                    print(f"  {'expert ' + token:<10} {grid.expert_group_of(args.highlight, token)}")
        if grid.world_size <= 128:
            print(grid.coords_table())
        else:
            print(f"(per-rank coordinates omitted for {grid.world_size} ranks)")
        return 0

    if args.engine == "matplotlib":
        import matplotlib

        matplotlib.use("Agg")
        fig = rankmap.rank_map_figure(grid, highlight=args.highlight, num_layers=args.num_layers)
        rankmap.save(fig, out)
    else:
        import graphviz

        dot = rankmap.rank_map(grid, highlight=args.highlight, num_layers=args.num_layers)
        try:
            rankmap.save(dot, out)
        except graphviz.ExecutableNotFound:
            raise UsageError("Graphviz's 'dot' program is not installed; install graphviz, or use "
                             "--out NAME.dot, or --engine matplotlib") from None
    print(f"wrote {out} ({grid!r})", file=sys.stderr)
    return 0
