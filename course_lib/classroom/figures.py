"""``python -m course_lib figures --out figures``: regenerate every figure in ``figures/``.

Each lab module that owns pictures registers a writer here: a function
``write(out_dir: Path) -> list[Path]``. Figures are written from the same tested
functions the notebooks call, so the pictures in the repo never drift from the code.
The notebooks' theory shows them as ``![caption](../figures/NAME.png)``
(:mod:`course_lib.classroom.notebooks.figures`); their PNGs are kept small (:func:`compact_png`).

What may be replaced (``figures/`` is generated output that ``make figures`` refreshes,
but a person's file must never be lost):

1. ``--out`` is checked first (a folder that can be written), before anything is drawn;
2. every figure is drawn into a temporary folder, so the full list of names is known
   before anything in ``--out`` is touched;
3. a name absent from ``--out`` is created; one holding the very same bytes is left
   alone; one holding other bytes is replaced only when it is still exactly what this
   command wrote there last time (recorded in ``--out/.course_outputs.json``, see
   ``safe_files.OutputLedger``), or with ``--force``. Otherwise (a person's file of
   the same name, or a figure edited by hand) nothing at all is written and the error
   names the files;
4. files in ``--out`` that this command does not draw are never touched, with or
   without ``--force``; each write is atomic.

The committed ``figures/`` carries its ledger, so ``make figures`` refreshes it on any
machine without ``--force``.
"""

from __future__ import annotations

import importlib
import io
import sys
import tempfile
from pathlib import Path

from course_lib.safe_files import OutputLedger, OutputPathError, check_output_dir, write_atomic

# module path -> function name; each function takes the output folder and returns the paths it wrote
WRITERS = {
    "course_lib.communication_patterns": "write_figures",
    "course_lib.topology.figures": "write_figures",
    "course_lib.pipeline.plots": "write_figures",
    "course_lib.classroom.figures": "write_theory_figures",
    "course_lib.sweep": "write_figures",
    "course_lib.distributed.plots": "write_figures",
    "course_lib.moe.plots": "write_figures",
    "course_lib.deepspeed.plots": "write_figures",
    "course_lib.data.plots": "write_figures",
}
# The PNGs of these writers are stored as 64-colour palettes: the same picture to the eye, 4-6 times
# smaller, since the labs carry them as cell attachments (course_lib.classroom.notebooks.figures). The sweep's
# plots stay exactly as `make sweep` publishes them.
COMPACT_WRITERS = ("course_lib.communication_patterns", "course_lib.topology.figures", "course_lib.pipeline.plots",
                   "course_lib.classroom.figures", "course_lib.distributed.plots", "course_lib.moe.plots",
                   "course_lib.deepspeed.plots", "course_lib.data.plots")
PALETTE_COLOURS = 64
_LISTED_CONFLICTS = 5  # names shown in the refusal; the rest are counted


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="figures", type=Path, help="output folder (default: figures)")
    parser.add_argument("--force", action="store_true",
                        help="also replace files of the same names that this command did not write (or that were "
                             "edited since); files it does not draw are never touched")


def compact_png(data: bytes) -> bytes:
    """A PNG as an optimised palette PNG of :data:`PALETTE_COLOURS` colours (median cut, on white)."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGBA")
    flat = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image).convert("RGB")
    buffer = io.BytesIO()
    flat.quantize(colors=PALETTE_COLOURS, method=Image.Quantize.MEDIANCUT).save(buffer, "PNG", optimize=True)
    return buffer.getvalue()


# Lab 09's tiny GPT and its first layout (the lab trains the same model with the same flags)
CHECKPOINT_MODEL = ["--uniform-vocab-padding", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3"]
CHECKPOINT_LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# the slice map's rows: the embedding, the layers' linears (stacked over the layers), a LayerNorm
CHECKPOINT_MAP_TENSORS = (r"^(embedding\.word_embeddings\.weight|decoder\.layers\.self_attention\.linear_qkv\.layer_norm_weight|"
                          r"decoder\.layers\.(self_attention\.linear_(qkv|proj)|mlp\.linear_fc[12])\.(weight|bias))$")


def _save_one_iteration(save: str) -> None:
    from course_lib.train import parse_args, pretrain

    pretrain(parse_args(CHECKPOINT_MODEL + CHECKPOINT_LAYOUT + ["--train-iters", "1", "--lr-warmup-iters", "0",
                                                                "--save", save, "--save-interval", "1"]),
             print_args=False)


def checkpoint_slice_map(save_dir):
    """Save Lab 09's tiny GPT under TP2 x PP2 x DP2 on 8 real ranks (one iteration, ``--save save_dir``)
    and return its slice map (:func:`course_lib.training.checkpoint_inspect.slice_map_figure` of the
    files written, rows :data:`CHECKPOINT_MAP_TENSORS`)."""
    import torch.distributed.checkpoint  # noqa: F401 -- imported once here, inherited by the forked ranks

    from course_lib.launch import launch
    from course_lib.training.checkpoint_inspect import describe_checkpoint, slice_map_figure

    launch(_save_one_iteration, world_size=8, output="none", timeout=120, save=str(save_dir))
    return slice_map_figure(describe_checkpoint(save_dir), CHECKPOINT_MAP_TENSORS)


def write_theory_figures(out_dir) -> list[Path]:
    """Pictures only a lab's theory needs (no other module draws them into ``figures/``).

    ``cp_ring_steps_cp4_contiguous.png``: Lab 04 §4.3, the causal ring on 4 ranks with a contiguous
    split -- the last rank computes most blocks, the reason for the zigzag split. Drawn by
    :func:`course_lib.context_parallel.plot_ring_steps` from the schedule ring attention runs.

    ``ckpt_slices_8_tp2_pp2_dp2.png``: Lab 09 §1, which slice of each tensor each of 8 ranks holds and
    writes in a torch_dist checkpoint, drawn from the ``.metadata`` of a real save (:func:`checkpoint_slice_map`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.context_parallel import plot_ring_steps
    from course_lib.safe_files import save_and_close_figure
    from course_lib.topology.rankmap import save

    ring = save_and_close_figure(plot_ring_steps(4, layout="contiguous", causal=True),
                                 Path(out_dir) / "cp_ring_steps_cp4_contiguous.png")
    with tempfile.TemporaryDirectory(prefix="course_ckpt_") as scratch:
        fig = checkpoint_slice_map(scratch)
    slices = save(fig, Path(out_dir) / "ckpt_slices_8_tp2_pp2_dp2.png", dpi=80)
    plt.close(fig)
    return [ring, slices]


def draw_all(folder: Path) -> dict[str, bytes]:
    """Run every writer into ``folder``; return ``{name relative to folder: bytes}`` of what they wrote
    (the PNGs of :data:`COMPACT_WRITERS` as palette PNGs)."""
    figures: dict[str, bytes] = {}
    for module, name in WRITERS.items():
        for path in getattr(importlib.import_module(module), name)(folder):
            data = Path(path).read_bytes()
            if module in COMPACT_WRITERS and Path(path).suffix.lower() == ".png":
                data = compact_png(data)
            figures[Path(path).relative_to(folder).as_posix()] = data
    return figures


def plan_writes(ledger: OutputLedger, figures: dict[str, bytes], *, force: bool) -> list[str]:
    """The names in ``figures`` to write into the ledger's folder (new or changed), or ``OutputPathError``
    naming every file that may not be replaced (see the module docstring)."""
    out = ledger.folder
    to_write, refused = [], []
    for name, data in figures.items():
        target = out / name
        if target.is_file() and target.read_bytes() == data:
            continue
        if target.exists() and (target.is_dir() or not (force or ledger.is_own(name))):
            refused.append(name)
        else:
            to_write.append(name)
    if refused:
        shown = ", ".join(refused[:_LISTED_CONFLICTS])
        more = f" and {len(refused) - _LISTED_CONFLICTS} more" if len(refused) > _LISTED_CONFLICTS else ""
        raise OutputPathError(f"--out {out}: {shown}{more} already there, not as this command last wrote them "
                              f"(a file of yours, or a figure edited since); nothing was written: pass --force to "
                              f"replace them, or choose another folder")
    return to_write


def run(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    out = check_output_dir(args.out, what="--out")
    ledger = OutputLedger(out)  # a .course_outputs.json that is not ours is refused before any drawing
    with tempfile.TemporaryDirectory(prefix="course_figures_") as scratch:
        figures = draw_all(Path(scratch))
    to_write = plan_writes(ledger, figures, force=args.force)
    for name, data in figures.items():
        if name in to_write:
            print(f"wrote {write_atomic(out / name, data)}")
        ledger.record(name, data)
    ledger.save()
    print(f"{len(figures) - len(to_write)} of {len(figures)} figures unchanged in {out}", file=sys.stderr)
    return 0
