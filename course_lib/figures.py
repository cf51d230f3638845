"""``python -m course_lib figures --out figures``: regenerate every figure in ``figures/``.

Each lab module that owns pictures registers a writer here: a function
``write(out_dir: Path) -> list[Path]``. Figures are written from the same tested
functions the notebooks call, so the pictures in the repo never drift from the code.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# module path -> function name; each function takes the output folder and returns the paths it wrote
WRITERS = {
    "course_lib.collectives": "write_figures",
    "course_lib.figures_topology": "write_figures",
    "course_lib.pipeline.plots": "write_figures",
    "course_lib.sweep": "write_figures",
}


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="figures", type=Path, help="output folder (default: figures)")


def run(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    for module, name in WRITERS.items():
        for path in getattr(importlib.import_module(module), name)(args.out):
            print(f"wrote {path}")
    return 0
