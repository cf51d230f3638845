"""``python -m course_lib checkpoint inspect DIR [--out MAP.svg|png]``: what a checkpoint holds and which
rank wrote which slice.

Reads the files only (no process group, no model): the tracker, ``common.pt`` (or a legacy file's
common part), and for ``torch_dist`` DCP's ``.metadata`` -- every tensor's global shape and dtype, and
its chunks, each with its global offsets and the file (``__R_0.distcp``: rank ``R``) that holds it.
A legacy ``torch`` checkpoint lists each ``mp_rank_*`` file's tensors with their local shapes.
See :mod:`course_lib.training.checkpointing` for the layout.

``--out`` draws the slice map (:func:`slice_map_figure`), like the rank map: tensors x ranks, each
cell the tensor's global extent with the slice that rank holds -- dark where its own file stores it,
light where a replica's file does (DCP writes each distinct chunk once).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from course_lib.safe_files import check_output_file
from course_lib.topology.grid import RankGrid

from course_lib.training.checkpointing import (COMMON_FILE, LAYER_AXIS_KEY, LEGACY_FILE, TRACKER, CheckpointError,
                                               _dist_metadata, _torch_load, checkpoint_dir, checkpoint_format,
                                               read_metadata)
from course_lib.rules import UsageError

__all__ = ["describe_checkpoint", "format_description", "holders", "slice_map_figure", "add_arguments", "run"]

MODEL_TENSORS = r"^(?!optimizer\.)"     # --tensors default: the optimizer's state has its parameter's slices
MAP_MAX_TENSORS = 80                     # rows of one slice map (a taller one is unreadable)


def _resolve(path: Path) -> tuple[Path, int]:
    """``(iter folder, iteration)`` for a checkpoints folder (its tracker) or an ``iter_XXXXXXX`` folder."""
    if (path / TRACKER).is_file():
        iteration = read_metadata(path / TRACKER)
        return checkpoint_dir(path, iteration), iteration
    match = re.fullmatch(r"iter_(\d{7})", path.name)
    if match and path.is_dir():
        return path, int(match.group(1))
    raise CheckpointError(f"{path} has no {TRACKER} and is no iter_XXXXXXX folder: not a checkpoint; "
                          f"give the --save folder of a run")


def _slices(offsets, sizes) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def describe_checkpoint(path) -> dict:
    """``{"path", "iteration", "format", "layout", "consumed_train_samples", "files": [(name, bytes)],
    "tensors": [{"key", "shape", "dtype", "bytes", "slices": [(rank or file, "[a:b, c:d]")],
    "chunks": [(rank, offsets, sizes)] (torch_dist only)}]}``."""
    ckpt, iteration = _resolve(Path(path))
    fmt = checkpoint_format(ckpt)
    files = sorted((str(f.relative_to(ckpt)), f.stat().st_size) for f in ckpt.rglob("*") if f.is_file())
    tensors = []
    if fmt == "torch_dist":
        from course_lib.training.dcp_io import written_chunks

        common = _torch_load(ckpt / COMMON_FILE)
        md = _dist_metadata(ckpt)
        for key, written in sorted(written_chunks(md).items()):
            tmd = md.state_dict_metadata[key]
            dtype = tmd.properties.dtype
            numel = 1
            for n in tmd.size:
                numel *= n
            chunks = sorted((int(re.match(r"__(\d+)_", f).group(1)), o, z) for f, o, z in written)   # file: rank
            tensors.append({"key": key, "shape": list(tmd.size), "dtype": str(dtype).replace("torch.", ""),
                            "bytes": numel * torch.empty(0, dtype=dtype).element_size(),
                            "slices": [(r, _slices(o, z)) for r, o, z in chunks], "chunks": chunks})
    else:
        legacy = sorted(ckpt.glob(f"mp_rank_*/{LEGACY_FILE}"))
        common = _torch_load(legacy[0])
        for f in legacy:
            state = _torch_load(f)
            for part, values in state.items():
                if re.fullmatch(r"model\d*", part):
                    for key, t in values.items():
                        tensors.append({"key": key, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                        "bytes": t.numel() * t.element_size(),
                                        "slices": [(f.parent.name, _slices([0] * t.dim(), t.shape))]})
    return {"path": str(ckpt), "iteration": iteration, "format": fmt, "layout": common["layout"],
            "consumed_train_samples": common["consumed_train_samples"], "files": files, "tensors": tensors}


def format_description(d: dict) -> str:
    """The table ``inspect`` prints."""
    lay = d["layout"]
    out = [f"checkpoint {d['path']}",
           f"  iteration {d['iteration']} | format {d['format']} | consumed samples {d['consumed_train_samples']} | "
           f"saved under TP{lay['tp']} x PP{lay['pp']} x CP{lay['cp']} x DP{lay['dp']} (VP{lay['vpp']}, world "
           f"{lay['world_size']}, state sharding: {lay['strategy'] or 'none'})",
           "  files:"]
    out += [f"    {name:<40} {size:>10} bytes" for name, size in d["files"]]
    if d["format"] == "torch":
        out.append("  tensors (legacy: each model-parallel rank's own shapes, no global offsets):")
    else:
        out.append("  tensors (global shape; each slice: the rank whose file holds it, global [start:end] per dim):")
    width = max([len(t["key"]) for t in d["tensors"]] + [6])
    out.append(f"    {'tensor':<{width}}  {'shape':<14} {'dtype':<9} {'bytes':>9}  slices")
    for t in d["tensors"]:
        where = "  ".join(f"{'r' if isinstance(r, int) else ''}{r} {s}" for r, s in t["slices"])
        out.append(f"    {t['key']:<{width}}  {str(t['shape']):<14} {t['dtype']:<9} {t['bytes']:>9}  {where}")
    return "\n".join(out)


EXPERT_KEY = re.compile(r"\.mlp\.experts\.")    # an MoE layer's stacked experts (course_lib.moe.transformer)


def _grid(layout: dict) -> RankGrid:
    return RankGrid(layout["world_size"], tp=layout["tp"], pp=layout["pp"], cp=layout["cp"],
                    ep=layout.get("ep", 1), expert_tp=layout.get("expert_tp"))


def holders(layout: dict, tensor: dict) -> dict[int, list[tuple]]:
    """``{rank: [(offsets, sizes, writer)]}``: the chunks of ``tensor`` (an entry of
    :func:`describe_checkpoint`'s ``"tensors"``, torch_dist) each rank of the saved ``layout`` held.

    A chunk's writer (the rank of its ``__R_0.distcp``) held it, and so did the writer's replicas
    (DCP wrote the chunk once for all of them): its DP x CP group when the chunk is cut from the tensor
    (a TP shard), every rank of its pipeline stage (TP x DP x CP) when it is the whole tensor -- of one
    layer, for the decoder's tensors stacked over the layers (LayerNorms, a row-parallel bias, any tensor
    under TP1); for an MoE layer's experts, its expert data-parallel group (Megatron's second grid). The
    last stage's copy of a tied embedding is not saved, so it is not shown."""
    grid, shape = _grid(layout), tensor["shape"]
    own = 1 if LAYER_AXIS_KEY.search(tensor["key"]) else 0  # the tensor's own dims (after the layer axis)

    def replicas(writer, sizes):
        if EXPERT_KEY.search(tensor["key"]):
            return grid.expert_group_of(writer, "dp")
        return grid.group_of(writer, "tp-dp-cp" if list(sizes[own:]) == shape[own:] else "dp-cp")

    out: dict[int, list[tuple]] = {}
    for writer, offsets, sizes in tensor["chunks"]:
        for r in replicas(writer, sizes):
            out.setdefault(r, []).append((offsets, sizes, writer))
    return out


def _select(d: dict, tensors: str) -> list[dict]:
    if d["format"] != "torch_dist":
        raise UsageError(f"{d['path']} is a legacy torch checkpoint: its files hold each model-parallel rank's own "
                         f"shapes, with no global offsets to draw; save with --ckpt-format torch_dist")
    try:
        rows = [t for t in d["tensors"] if re.search(tensors, t["key"])]
    except re.error as exc:
        raise UsageError(f"--tensors {tensors!r} is not a regular expression ({exc})") from None
    if not rows:
        raise UsageError(f"--tensors {tensors!r} matches none of the {len(d['tensors'])} tensors of {d['path']}; "
                         f"the table without --out lists their names")
    if len(rows) > MAP_MAX_TENSORS:
        raise UsageError(f"--tensors {tensors!r} matches {len(rows)} tensors: a map draws at most "
                         f"{MAP_MAX_TENSORS}; narrow it, e.g. --tensors 'linear_fc1'")
    return rows


def _box(offsets, sizes, shape, across: int) -> tuple[float, float, float, float]:
    """``(x, y, width, height)`` of a chunk in a unit square: dim 0 downwards (the layer axis of a tensor
    stacked over the layers), dim ``across`` across (a 1-d tensor: dim 0 across); other dims are drawn whole."""
    if len(shape) == 0:
        return 0.0, 0.0, 1.0, 1.0
    if len(shape) == 1:
        return offsets[0] / shape[0], 0.0, sizes[0] / shape[0], 1.0
    return offsets[across] / shape[across], offsets[0] / shape[0], sizes[across] / shape[across], sizes[0] / shape[0]


def slice_map_figure(d: dict, tensors: str = MODEL_TENSORS, *, title: str | None = None):
    """The slice map of a torch_dist checkpoint (``d``: :func:`describe_checkpoint`): one row per tensor
    whose key matches ``tensors`` (default: the model's; the optimizer's state has the slices of its
    parameter), one column per rank of the saved layout; each cell is the tensor's global extent (dim 0
    downwards, across the first dim after it that the chunks cut) with the slices that rank held
    (:func:`holders`), one colour per chunk -- solid where the rank's own file stores the chunk, pale where a
    replica's does. Returns the ``Figure``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rows = _select(d, tensors)
    lay, grid = d["layout"], _grid(d["layout"])
    world = lay["world_size"]
    cw, ch, gap = 1.0, 0.62, 0.22
    label_w = max(len(f"{t['key']} {t['shape']}") for t in rows) * 0.075
    fig, ax = plt.subplots(figsize=(min(3.0 + label_w + 0.95 * world, 30.0), 1.6 + 0.4 * len(rows)))
    palette = plt.get_cmap("tab10").colors
    for r in range(world):
        c = grid.coords(r)
        coords = "\n".join(f"{k} {c[k]}" for k in ("tp", "cp", "dp", "pp") if lay[k] > 1)
        ax.text(r * (cw + gap) + cw / 2, 0.1, f"rank {r}\n{coords}".strip(), ha="center", va="bottom", fontsize=7)
    for i, t in enumerate(rows):
        y0 = -(i + 1) * (ch + gap)
        ax.text(-0.15, y0 + ch / 2, f"{t['key']} {t['shape']}", ha="right", va="center", fontsize=7,
                family="monospace")
        colour = {(o, z): palette[k % len(palette)] for k, (_, o, z) in enumerate(t["chunks"])}
        held = holders(lay, t)
        across = next((k for k in range(1, len(t["shape"])) if any(z[k] < t["shape"][k] for _, _, z in t["chunks"])), 1)
        one_d = len(t["shape"]) <= 1
        h, yb = (ch * 0.4, y0 + ch * 0.3) if one_d else (ch, y0)
        for r in range(world):
            x0 = r * (cw + gap)
            ax.add_patch(Rectangle((x0, yb), cw, h, fill=False, edgecolor="#bbbbbb", lw=0.6, zorder=1))
            for offsets, sizes, writer in held.get(r, []):
                bx, by, bw, bh = _box(offsets, sizes, t["shape"], across)
                own = writer == r
                ax.add_patch(Rectangle((x0 + bx * cw, yb + (1 - by - bh) * h), bw * cw, bh * h,
                                       facecolor=colour[(offsets, sizes)], alpha=1.0 if own else 0.28,
                                       edgecolor="black" if own else "none", lw=0.5, zorder=2))
    handles = [Patch(facecolor=palette[0], edgecolor="black", lw=0.5, label="in this rank's file (__R_0.distcp)"),
               Patch(facecolor=palette[0], alpha=0.28, label="held by this rank, stored in a replica's file"),
               Patch(facecolor="white", edgecolor="#bbbbbb", label="not on this rank (another stage)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)
    saved = " x ".join(f"{k.upper()}{lay[k]}" for k in ("tp", "pp", "cp", "dp"))
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    ax.set_title(title or f"iteration {d['iteration']}, saved under {saved} ({ranks}):\nwhich slice of each tensor "
                          f"each rank holds (one colour per chunk)", fontsize=9, loc="left")
    header_lines = 1 + sum(lay[k] > 1 for k in ("tp", "cp", "dp", "pp"))
    ax.set_xlim(-0.3, world * (cw + gap))
    ax.set_ylim(-(len(rows) + 1) * (ch + gap) + gap - 0.1, 0.3 + 0.22 * header_lines)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("inspect", help="iteration, format, saved layout, every tensor and which rank holds which slice")
    p.add_argument("dir", help="a --save folder (its latest checkpoint) or one iter_XXXXXXX folder")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="also draw the slice map (tensors x ranks): .svg, .png or .pdf (torch_dist checkpoints)")
    p.add_argument("--tensors", default=MODEL_TENSORS, metavar="REGEX",
                   help="the tensors to draw, a regular expression searched in each key (default: the model's, "
                        "without the optimizer's state)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    return parser


def run(args: argparse.Namespace) -> int:
    from course_lib.topology.rankmap import FORMATS_MATPLOTLIB, save

    out = None
    if args.out is not None:        # checked before anything is read
        if Path(args.out).suffix.lower() not in FORMATS_MATPLOTLIB:
            raise UsageError(f"--out {args.out}: the slice map is written as {', '.join(FORMATS_MATPLOTLIB)}; "
                             f"change the suffix")
        out = check_output_file(args.out, force=args.force, what="--out")
    d = describe_checkpoint(args.dir)
    print(format_description(d))
    if out is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = slice_map_figure(d, args.tensors)
        save(fig, out, dpi=110)
        plt.close(fig)
        print(f"wrote {out}", file=sys.stderr)
    return 0
