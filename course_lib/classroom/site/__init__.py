"""``python -m course_lib site --out build/site``: the course as a static website (``make site``).

An index (the README's course map with time budgets, and its glossary) and one page per
lab: theory, pictures, code and the stored outputs of ``solutions/`` — exercise cells show
the student's stub, never the solution, and lose their outputs. Pages need no network:
open ``build/site/index.html`` from disk or put the folder on any static host.

* :mod:`course_lib.classroom.site.build` -- the pages (nbconvert's ``HTMLExporter``, :file:`page.html.j2`);
* :mod:`course_lib.classroom.site.reader` -- what a reader sees of a notebook, and the solution-leak check;
* :mod:`course_lib.classroom.site.pictures` -- figures beside the theory, widgets' default views;
* :mod:`course_lib.classroom.site.readme` -- the README's tables;
* :mod:`course_lib.classroom.site.browser` -- headless Chromium, to check the built pages as a reader sees them.

Writing follows :mod:`course_lib.safe_files`: ``--out`` is checked before any work; a file
is replaced only when it is still what this command wrote there last time (the folder's
``.course_outputs.json``) or with ``--force``; files it does not write are never touched.
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_OUT = Path("build/site")


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, type=Path, help=f"output folder (default: {DEFAULT_OUT})")
    parser.add_argument("--solutions", default=Path("solutions"), type=Path,
                        help="the solution notebooks (default: solutions)")
    parser.add_argument("--figures", default=Path("figures"), type=Path,
                        help="the drawn figures shown beside the theory (default: figures)")
    parser.add_argument("--readme", default=Path("README.md"), type=Path,
                        help="where the course map and glossary tables are read (default: README.md)")
    parser.add_argument("--labs", nargs="+", metavar="NN", help="build only these labs (e.g. 00 03)")
    parser.add_argument("--force", action="store_true",
                        help="also replace files of the same names that this command did not write (or that were "
                             "edited since); files it does not write are never touched")


def run(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.classroom.figures import plan_writes
    from course_lib.safe_files import OutputLedger, check_output_dir, write_atomic
    from course_lib.classroom.site.build import build_site

    out = check_output_dir(args.out, what="--out")
    ledger = OutputLedger(out)  # a .course_outputs.json that is not ours is refused before any building
    files = build_site(args.solutions, args.figures, args.readme, only=args.labs)
    to_write = plan_writes(ledger, files, force=args.force)
    for name, data in files.items():
        if name in to_write:
            write_atomic(out / name, data)
        ledger.record(name, data)
    ledger.save()
    pages = sum(name.endswith(".html") for name in files)
    print(f"{pages} pages, {len(files)} files in {out} ({len(to_write)} written, "
          f"{len(files) - len(to_write)} unchanged); open {out / 'index.html'}", file=sys.stderr)
    return 0
