"""What a reader of the website sees of one solution notebook, and the check that no solution leaks.

The page of a lab shows what the student notebook shows (``labgen.make_lab``: every
solution block replaced by its ``NotImplementedError`` stub) plus the stored outputs of
every cell that is *not* an exercise. An exercise cell's outputs were produced by the
solution (a printed answer, a plot of it), so they are dropped. A checker cell's stored
"✓ ..." line was printed for the solution too: right under the stub it would read as if
the stub had passed, so it is shown only under :data:`SUCCESS_LABEL` (what success looks
like), never as the cell's own result.

:func:`solution_lines` and :func:`leaked_lines` are the independent check: the lines
between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` that the student version never
shows must not be lines of a page's text.
"""

from __future__ import annotations

import copy
from course_lib.classroom.notebooks.generator import BEGIN, END, EXERCISE_TAGS, HINT, make_lab

# Test-harness markers: meaningful to nbval, noise to a reader.
_HARNESS_LINE_PREFIXES = ("# NBVAL_",)
EXERCISE_TAG = EXERCISE_TAGS[0]
VERDICT_MARKS = ("✓", "✗")
"""A checker's verdict line starts with one of these (:mod:`course_lib.classroom.checks`)."""
SUCCESS_LABEL = ("What success looks like (the checker's line for the course's own solution; "
                 "the stub above has not run -- your notebook prints its own verdict):\n")


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def is_exercise(cell: dict) -> bool:
    """A cell of the student notebook that holds a stub (``make_lab`` tagged it)."""
    return EXERCISE_TAG in cell.get("metadata", {}).get("tags", [])


def _without_harness_lines(source: str) -> str:
    lines = source.splitlines(keepends=True)
    return "".join(line for line in lines if not line.lstrip().startswith(_HARNESS_LINE_PREFIXES))


def _labelled_verdicts(outputs: list) -> list:
    """``outputs`` with every checker verdict labelled as what success looks like (:data:`SUCCESS_LABEL`)."""
    out = copy.deepcopy(outputs)
    for output in out:
        if output.get("output_type") != "stream":
            continue
        text = output.get("text", "")
        text = "".join(text) if isinstance(text, list) else text
        if any(line.lstrip().startswith(VERDICT_MARKS) for line in text.splitlines()):
            output["text"] = SUCCESS_LABEL + text
            break
    return out


def reader_notebook(solution: dict) -> dict:
    """The notebook a lab page renders: the student version, with the solution's outputs of non-exercise cells.

    Exercise cells keep the stub and lose their outputs and execution count; a checker's verdict
    is labelled as what success looks like; nbval markers (``# NBVAL_IGNORE_OUTPUT``) are dropped
    from the code shown. Raises
    ``labgen``'s one-line ``ValueError`` for a malformed notebook or a misplaced marker.
    """
    lab = make_lab(solution)
    for solved, cell in zip(solution["cells"], lab["cells"]):
        if cell["cell_type"] != "code":
            continue
        cell["source"] = _without_harness_lines(_source(cell))
        if is_exercise(cell):
            cell["outputs"], cell["execution_count"] = [], None
        else:
            cell["outputs"] = _labelled_verdicts(solved.get("outputs", []))
            cell["execution_count"] = solved.get("execution_count")
    lab.get("metadata", {}).pop("widgets", None)  # saved widget state: meaningless without a kernel
    return lab


def _solution_block_lines(solution: dict) -> list[str]:
    """The stripped, non-blank lines inside solution blocks, hints excepted."""
    found = []
    for cell in solution.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        inside = False
        for line in _source(cell).splitlines():
            stripped = line.strip()
            if stripped.startswith(BEGIN):
                inside = True
            elif stripped.startswith(END):
                inside = False
            elif inside and stripped and not stripped.startswith(HINT):
                found.append(stripped)
    return found


def solution_lines(solution: dict) -> set[str]:
    """Lines of the solution blocks that the student version never shows (stripped).

    A solution line that also appears elsewhere in the lab (say ``import torch``) shows
    nothing away, so it is left out; what remains must never be a line of a page.
    """
    lab = make_lab(solution)
    shown = {line.strip() for cell in lab["cells"] for line in _source(cell).splitlines()}
    return {line for line in _solution_block_lines(solution) if line not in shown}


def leaked_lines(page_text: str, secret: set[str]) -> list[str]:
    """The lines of ``secret`` that are lines of ``page_text`` (compared stripped), in page order."""
    return [line for line in dict.fromkeys(raw.strip() for raw in page_text.splitlines()) if line in secret]

