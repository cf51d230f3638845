"""Classes of students for the tests of ``grade``: mini labs (an official solution cut to what its exercises need)
and a student's copy of a lab. Shared by ``test_grade.py`` (Lab 01) and ``test_grade_class_every_lab.py`` (every
lab); this folder is on sys.path (no __init__.py: rootdir-relative import mode).
"""

from __future__ import annotations

import json
from pathlib import Path

from course_lib.classroom.grading.official import current_lab, defined_names, source_of, units_of
from course_lib.classroom.notebooks.independent_cells import _names

STUB = object()
"""In a student's ``sources``: this exercise's cell is the lab's stub."""


def mini_solution(official: Path, folder: Path, leave_out=()) -> Path:
    """``official`` (a solution notebook) cut to its units -- the exercise and checker cells, as they are -- and
    the code cells they need, written to ``folder/solutions/``; the units of the exercises ``leave_out`` are left
    out. A cell is needed when it binds a name that a kept cell after it reads (a backward pass over
    :func:`~course_lib.classroom.notebooks.independent_cells._names`): what a cell leaves behind without binding a
    name (a file it writes) is not seen, and every lab's exercises pass without it (the solved students show it)."""
    solution = json.loads(official.read_text(encoding="utf-8"))
    cells = solution["cells"]
    keep = {i for unit in current_lab(official).units if not set(unit.exercises) & set(leave_out) for i in unit.cells}
    needed: set[str] = set()
    for index in range(len(cells) - 1, -1, -1):
        if cells[index]["cell_type"] != "code":
            continue
        reads, binds = _names(source_of(cells[index]))
        if index in keep or binds & needed:
            keep.add(index)
            needed |= reads
    solution["cells"] = [cells[i] for i in sorted(keep)]
    path = folder / "solutions" / official.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(solution, indent=1), encoding="utf-8")
    return path


def student(lab: dict, solution: dict, sources: dict | None = None, *, solved: bool = True) -> dict:
    """A student's copy of the lab: each exercise cell the solution's (``solved``), else the stub, with ``sources``
    in their place: keyed by a name the cell defines or, for a mini lab's graded exercises, by the exercise it is
    graded as; a value is the cell's source, or :data:`STUB`."""
    units = {i: u.exercises for u in units_of(lab) for i in u.exercise_cells}
    notebook = json.loads(json.dumps(lab))
    for index, (cell, solved_cell) in enumerate(zip(notebook["cells"], solution["cells"])):
        if "exercise" not in cell.get("metadata", {}).get("tags", []):
            continue
        keys = [*units.get(index, ()), *sorted(defined_names(source_of(cell)))]
        mine = next((sources[k] for k in keys if k in (sources or {})), None)
        if mine is None:
            mine = source_of(solved_cell) if solved else STUB
        cell["source"] = source_of(cell) if mine is STUB else mine
    return notebook


def write(path: Path, notebook) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(notebook if isinstance(notebook, str) else json.dumps(notebook, indent=1), encoding="utf-8")
