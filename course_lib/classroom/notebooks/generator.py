"""Generate the student notebooks in ``labs/`` from the instructor notebooks in ``solutions/``.

``solutions/NN_topic.ipynb`` is the single source. In a code cell, exercise code
sits between a line ``### BEGIN SOLUTION`` and a line ``### END SOLUTION``
(nbgrader's convention). The student version replaces each block by a stub that
raises ``NotImplementedError``; a line ``### HINT: text`` inside the block becomes
the stub's message. Outputs are cleared and exercise cells are tagged
``raises-exception`` so ``pytest --nbval-lax labs/`` accepts the stub's error.
A marker anywhere else (a markdown cell, after code on a line, in lower case)
would leak the solution into the lab, so it is refused. A theory picture,
``![caption](../figures/NAME.png)`` in a markdown cell, travels inside the lab as a
cell attachment (:mod:`course_lib.classroom.notebooks.figures`).

Each lab carries a stamp (:mod:`course_lib.classroom.notebooks.stamp`) proving it is what
the generator wrote. The generator replaces a lab only when the stamp proves
nobody edited it; an edited lab, or a notebook in ``labs/`` that no solution
generates, is kept and reported. Students work in their own copies in
``my-labs/`` (:mod:`course_lib.classroom.notebooks.workspace`), never in ``labs/``.

    python -m course_lib labs           # bring labs/ up to date (never over an edited notebook)
    python -m course_lib labs --check   # exit 1, saying why, when labs/ differs from what solutions/ give
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from course_lib.classroom.notebooks.figures import FIGURES_PREFIX, embed_figures
from course_lib.classroom.notebooks.stamp import content_hash, dumps, is_untouched, read_if_notebook, read_notebook, stamped
from course_lib.safe_files import check_output_dir, write_atomic
from course_lib.classroom.notebooks.workspace import DEFAULT_WORKSPACE, free_name
from course_lib.rules import UsageError

BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "### HINT:"
EXERCISE_TAGS = ("exercise", "raises-exception")
_DEFAULT_HINT = "replace this line with your solution"
SOLUTION_GLOB = "[0-9][0-9]_*.ipynb"
# Anything that looks like a marker: "begin solution", "END_SOLUTION", ... in any case.
_MARKER_LIKE = re.compile(r"(?i)\b(?:begin|end)[\s_-]*solution")


def stub_source(source: str) -> tuple[str, int]:
    """Replace every solution block in ``source``; return (new source, number of blocks)."""
    out, block, indent, blocks = [], None, "", 0
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if block is not None:
                raise UsageError(f"line {number}: {BEGIN} inside another solution block; close it with {END}")
            block, indent = [], line[: len(line) - len(line.lstrip())]
        elif stripped.startswith(END):
            if block is None:
                raise UsageError(f"line {number}: {END} without a matching {BEGIN}")
            hints = [b.strip()[len(HINT):].strip() for b in block if b.strip().startswith(HINT)]
            message = " ".join(hints) or _DEFAULT_HINT
            out.append(f"{indent}# YOUR CODE HERE\n")
            out.append(f"{indent}raise NotImplementedError({message!r})\n")
            block, blocks = None, blocks + 1
        elif _MARKER_LIKE.search(line):
            raise UsageError(f"line {number}: {stripped!r} looks like a solution marker but is not one, so the "
                             f"solution would leak into the lab; write {BEGIN} / {END} alone on their lines, "
                             f"in capitals")
        elif block is not None:
            block.append(line)
        else:
            out.append(line)
    if block is not None:
        raise UsageError(f"{BEGIN} without a matching {END}")
    return "".join(out), blocks


def _where(index: int, cell) -> str:
    cell_id = cell.get("id") if isinstance(cell, dict) else None
    return f"cell {index}" + (f" (id {cell_id})" if isinstance(cell_id, str) else "")


def _checked_source(index: int, cell) -> str:
    """The cell's source as one string, after checking the cell has the shape of a notebook cell."""
    if not isinstance(cell, dict):
        raise UsageError(f"cell {index} is a JSON {type(cell).__name__}, not an object with 'cell_type' and 'source'")
    if cell.get("cell_type") not in ("code", "markdown", "raw"):
        raise UsageError(f"{_where(index, cell)}: 'cell_type' is {cell.get('cell_type')!r}, "
                         f"expected 'code', 'markdown' or 'raw'")
    metadata = cell.get("metadata", {})
    if not isinstance(metadata, dict) or not isinstance(metadata.get("tags", []), list):
        raise UsageError(f"{_where(index, cell)}: 'metadata' must be an object and its 'tags' a list")
    source = cell.get("source")
    if isinstance(source, list) and all(isinstance(line, str) for line in source):
        return "".join(source)
    if isinstance(source, str):
        return source
    raise UsageError(f"{_where(index, cell)}: 'source' is {type(source).__name__} {source!r:.40}, "
                     f"expected a string or a list of strings")


def _refuse_markers_in_text_cell(index: int, cell: dict, source: str) -> None:
    """Markdown and raw cells are copied to the lab as they are: a marker there would leak the solution."""
    for number, line in enumerate(source.splitlines(), 1):
        if _MARKER_LIKE.search(line):
            raise UsageError(f"{_where(index, cell)}: line {number}: {line.strip()!r} is a solution marker in a "
                             f"{cell['cell_type']} cell, which would leak into the lab; "
                             f"markers work only in code cells")


def make_lab(solution: dict) -> dict:
    """The student notebook (a notebook dict) for one solution notebook dict.

    Raises a one-line ``ValueError`` naming the cell for a malformed notebook or
    a solution marker that would leak.
    """
    if not isinstance(solution.get("cells"), list):
        raise UsageError("no 'cells' list: a Jupyter notebook is a JSON object with a 'cells' list")
    if not isinstance(solution.get("metadata", {}), dict):
        raise UsageError("the notebook's 'metadata' must be a JSON object")
    lab = copy.deepcopy(solution)
    # Saved widget state describes the solution run's outputs, which a lab does not have
    # (tens of kB of stale state in Labs 01, 03 and 06).
    lab.get("metadata", {}).pop("widgets", None)
    for index, cell in enumerate(lab["cells"]):
        source = _checked_source(index, cell)
        if cell["cell_type"] != "code":
            _refuse_markers_in_text_cell(index, cell, source)
            continue
        try:
            new_source, blocks = stub_source(source)
        except ValueError as exc:
            raise UsageError(f"{_where(index, cell)}: {exc}") from None
        cell["source"] = new_source
        cell["outputs"] = []
        cell["execution_count"] = None
        tags = [t for t in cell.get("metadata", {}).get("tags", []) if t not in EXERCISE_TAGS]
        if blocks:
            tags = [*tags, *EXERCISE_TAGS]
        cell.setdefault("metadata", {})
        if tags:
            cell["metadata"]["tags"] = tags
        else:
            cell["metadata"].pop("tags", None)
        cell["metadata"].pop("execution", None)
    return lab


def lab_notebook(solution_path: Path) -> dict:
    """The lab for one solution file: :func:`make_lab`, with its theory's ``../figures/NAME`` pictures
    carried as cell attachments (:mod:`course_lib.classroom.notebooks.figures`), so they show in ``my-labs/``
    (JupyterLab serves nothing above its root), on GitHub and before anything runs."""
    lab = make_lab(read_notebook(solution_path))
    embed_figures(lab, Path(solution_path).parent / FIGURES_PREFIX)
    return lab


def lab_text(solution_path: Path) -> str:
    """The exact text of the lab generated from one solution notebook, stamp included."""
    try:
        return dumps(stamped(lab_notebook(solution_path)))
    except ValueError as exc:
        message = str(exc)
        raise UsageError(message if message.startswith(str(solution_path)) else f"{solution_path}: {message}") from None


def solution_notebooks(solutions_dir: Path) -> list[Path]:
    """The ``NN_*.ipynb`` notebooks of ``solutions_dir``; a one-line error when there are none."""
    if not solutions_dir.is_dir():
        raise UsageError(f"--solutions {solutions_dir}: no such folder; give the folder of the solution "
                         f"notebooks (default: solutions); nothing was changed")
    found = sorted(solutions_dir.glob(SOLUTION_GLOB))
    if not found:
        raise UsageError(f"--solutions {solutions_dir}: no {SOLUTION_GLOB} notebooks in it; nothing was changed")
    return found


@dataclass(frozen=True)
class LabStatus:
    """One lab: where it goes, the text the generator gives it, and how the file on disk compares.

    ``state`` is ``current`` (identical), ``missing``, ``lags`` (what the generator wrote
    from older solutions: safe to replace) or ``edited`` (not provably generated: never replaced).
    """

    path: Path
    text: str
    state: str


def _state(path: Path, text: str) -> str:
    if not path.exists():
        return "missing"
    try:
        if path.read_bytes() == text.encode("utf-8"):
            return "current"
    except OSError:
        return "edited"
    existing = read_if_notebook(path)
    if existing is not None and (is_untouched(existing) or content_hash(existing) == content_hash(json.loads(text))):
        return "lags"  # stamped and unedited, or the same content without the stamp (labs made before stamps)
    return "edited"


def survey(solutions_dir: Path, labs_dir: Path) -> tuple[list[LabStatus], list[Path]]:
    """Every lab's status, and the notebooks in ``labs_dir`` that no solution generates."""
    if labs_dir.resolve() == solutions_dir.resolve():
        raise UsageError(f"--labs {labs_dir} is the --solutions folder; the labs go to a folder of their own")
    statuses = []
    for source in solution_notebooks(solutions_dir):
        path, text = labs_dir / source.name, lab_text(source)
        statuses.append(LabStatus(path, text, _state(path, text)))
    wanted = {status.path.name for status in statuses}
    extras = sorted(p for p in labs_dir.glob("*.ipynb") if p.name not in wanted)
    return statuses, extras


def _move_aside(path: Path, tag: str) -> str:
    """A shell command that moves ``path`` into the student workspace under a name not yet taken there.

    An edited lab gets ``NN_name.<tag>.ipynb``, so it never meets the workspace's own
    copy of the lab; another notebook keeps its name when that is free. ``mv -n`` never
    replaces a file, should one appear in between.
    """
    workspace = path.parent.parent / DEFAULT_WORKSPACE
    target = workspace / path.name
    if tag or target.exists():
        target = free_name(workspace, path.stem, tag or "mine")
    return f"mkdir -p {shlex.quote(str(workspace))} && mv -n {shlex.quote(str(path))} {shlex.quote(str(target))}"


def _edited_message(path: Path) -> str:
    return (f"{path} was edited by hand, so it is kept as is ({path.parent}/ is generated; work belongs in "
            f"{DEFAULT_WORKSPACE}/): to keep your edits and get the generated lab, `{_move_aside(path, 'edited')}`, "
            f"then `make labs`")


def _extra_message(path: Path, solutions_dir: Path) -> str:
    return (f"{path} has no solution in {solutions_dir}/, so it is kept as is ({path.parent}/ holds only "
            f"generated labs; keep your own notebooks in {DEFAULT_WORKSPACE}/: `{_move_aside(path, '')}`)")


def check(solutions_dir: Path, labs_dir: Path) -> int:
    """Report, without writing, whether ``labs_dir`` is what ``solutions_dir`` gives; 0 when it is."""
    statuses, extras = survey(solutions_dir, labs_dir)
    lagging = [s.path.name for s in statuses if s.state in ("missing", "lags")]
    problems = []
    if lagging:
        problems.append(f"{labs_dir}/ lags {solutions_dir}/ for {', '.join(lagging)}: run `make labs` "
                        f"(safe: it never overwrites a notebook edited by hand)")
    problems += [_edited_message(s.path) for s in statuses if s.state == "edited"]
    problems += [_extra_message(path, solutions_dir) for path in extras]
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        return 1
    print(f"{labs_dir}/ is up to date")
    return 0


def generate(solutions_dir: Path, labs_dir: Path) -> int:
    """Write every missing or lagging lab; keep (and report) edited labs and notebooks with no solution.

    Returns 1 when an edited lab kept ``labs_dir`` from being brought up to date, else 0.
    Every solution is read and turned into a lab before anything is written.
    """
    statuses, extras = survey(solutions_dir, labs_dir)
    check_output_dir(labs_dir, what="--labs")
    for status in statuses:
        if status.state in ("missing", "lags"):
            write_atomic(status.path, status.text)
            print(f"wrote {status.path}")
        elif status.state == "edited":
            print(_edited_message(status.path), file=sys.stderr)
    for path in extras:
        print(_extra_message(path, solutions_dir), file=sys.stderr)
    return 1 if any(s.state == "edited" for s in statuses) else 0


def add_arguments(parser) -> None:
    parser.add_argument("--solutions", default="solutions", type=Path, help="source folder (default: solutions)")
    parser.add_argument("--labs", default="labs", type=Path, help="output folder (default: labs)")
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1, saying why, when labs/ is not current")


def run(args) -> int:
    return check(args.solutions, args.labs) if args.check else generate(args.solutions, args.labs)
