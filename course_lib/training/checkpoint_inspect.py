"""``python -m course_lib checkpoint inspect DIR``: what a checkpoint holds and which rank wrote which slice.

Reads the files only (no process group, no model): the tracker, ``common.pt`` (or a legacy file's
common part), and for ``torch_dist`` DCP's ``.metadata`` -- every tensor's global shape and dtype, and
its chunks, each with its global offsets and the file (``__R_0.distcp``: rank ``R``) that holds it.
A legacy ``torch`` checkpoint lists each ``mp_rank_*`` file's tensors with their local shapes.
See :mod:`course_lib.training.checkpointing` for the layout.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from course_lib.training.checkpointing import (COMMON_FILE, LEGACY_FILE, TRACKER, CheckpointError, _dist_metadata,
                                               _torch_load, checkpoint_dir, checkpoint_format, read_metadata)

__all__ = ["describe_checkpoint", "format_description", "add_arguments", "run"]


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
    "tensors": [{"key", "shape", "dtype", "bytes", "slices": [(rank or file, "[a:b, c:d]")]}]}``."""
    ckpt, iteration = _resolve(Path(path))
    fmt = checkpoint_format(ckpt)
    files = sorted((str(f.relative_to(ckpt)), f.stat().st_size) for f in ckpt.rglob("*") if f.is_file())
    tensors = []
    if fmt == "torch_dist":
        common = _torch_load(ckpt / COMMON_FILE)
        md = _dist_metadata(ckpt)
        owner = {(i.fqn, tuple(i.offset)): int(re.match(r"__(\d+)_", s.relative_path).group(1))
                 for i, s in md.storage_data.items() if i.offset is not None}
        for key, tmd in sorted(md.state_dict_metadata.items()):
            if not hasattr(tmd, "chunks"):
                continue                                     # per-rank objects (RNG states)
            dtype = tmd.properties.dtype
            numel = 1
            for n in tmd.size:
                numel *= n
            slices = sorted((owner.get((key, tuple(c.offsets)), "?"), _slices(c.offsets, c.sizes)) for c in tmd.chunks)
            tensors.append({"key": key, "shape": list(tmd.size), "dtype": str(dtype).replace("torch.", ""),
                            "bytes": numel * torch.empty(0, dtype=dtype).element_size(), "slices": slices})
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


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("inspect", help="iteration, format, saved layout, every tensor and which rank holds which slice")
    p.add_argument("dir", help="a --save folder (its latest checkpoint) or one iter_XXXXXXX folder")
    return parser


def run(args: argparse.Namespace) -> int:
    print(format_description(describe_checkpoint(args.dir)))
    return 0
