"""The official lab a submission is graded against, its exercises, and the notebook that is run.

The official lab is the one ``make labs`` generates from ``solutions/`` (:func:`current_lab`), or,
when a student's notebook is a copy of an older release, that release: its stamp
(:mod:`course_lib.classroom.notebooks.stamp`) names the generated lab it was copied from, which
``git`` still has in the history of ``labs/`` (:func:`lab_for`). An older release is graded only
when its exercise and checker cells are today's (then today's checkers grade it exactly as
they would have); otherwise the submission is refused in one line saying why.

A lab's *units* (:func:`units_of`) are what the grader times and blames: the exercise cells (those
the generator tagged ``exercise``: they hold the stubs) up to the checker cell that follows them,
and the exercises that cell grades -- found by reading which ``@exercise`` checkers it calls
(:func:`course_lib.classroom.checks.exercise.checkers_in`), without running anything.

The notebook that is run (:func:`graded_cells`) is a fresh copy of the official lab with only the
student's exercise cells put in: each found by its cell id, else as the student's cell that defines
the same functions; everything else -- the checker cells above all -- is the official lab's, so an
edited, deleted or faked checker cell changes nothing. A heavy cell that no exercise depends on (tagged
``labs-pass-skip``, proved so by :mod:`course_lib.classroom.notebooks.independent_cells` on the notebook
that is run) is left out: it cannot change a verdict, only the time a class takes to grade.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from course_lib.classroom.checks.exercise import checkers_in
from course_lib.classroom.notebooks.generator import EXERCISE_TAGS, lab_text
from course_lib.classroom.notebooks.independent_cells import SKIP_TAG, skip_problems
from course_lib.classroom.notebooks.stamp import recorded_hash

_DEFINED = re.compile(r"^(?:(?:async\s+)?(?:def|class)\s+(\w+)|(\w+)\s*=(?!=))", re.M)


def source_of(cell: dict) -> str:
    source = cell.get("source", "") if isinstance(cell, dict) else ""
    if isinstance(source, list):
        return "".join(s for s in source if isinstance(s, str))
    return source if isinstance(source, str) else ""


def defined_names(source: str) -> set[str]:
    """The functions, classes and names a cell defines at its top level (read as text: a cell that does
    not parse still names them)."""
    return {a or b for a, b in _DEFINED.findall(source)}


@dataclass(frozen=True)
class Unit:
    """Exercise cells and the checker cell after them: ``cells`` (first .. checker, as notebook indices),
    ``exercise_cells``, ``checker`` and the ``exercises`` it grades."""

    cells: range
    exercise_cells: tuple
    checker: int
    exercises: tuple


def _graded_by(source: str, checkers: dict) -> list[str]:
    """The exercises a cell's checker calls grade, in call order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a magic cell
        return []
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    found = []
    for node in calls:
        info = checkers.get(getattr(node.func, "id", None) or getattr(node.func, "attr", None))
        exercise = info.exercise_of(node) if info else None
        if exercise and exercise not in found:
            found.append(exercise)
    return found


def is_exercise_cell(cell: dict) -> bool:
    return cell.get("cell_type") == "code" and EXERCISE_TAGS[0] in cell.get("metadata", {}).get("tags", [])


def units_of(notebook: dict) -> list[Unit]:
    """The lab's units, in notebook order."""
    checkers = checkers_in()
    units, pending = [], []
    for index, cell in enumerate(notebook["cells"]):
        if cell.get("cell_type") != "code":
            continue
        if is_exercise_cell(cell):
            pending.append(index)
            continue
        exercises = _graded_by(source_of(cell), checkers)
        if exercises:
            first = pending[0] if pending else index
            units.append(Unit(range(first, index + 1), tuple(pending), index, tuple(exercises)))
            pending = []
    return units


@dataclass(frozen=True)
class OfficialLab:
    """One official lab: ``number`` ("03"), ``name`` (its file name), the generated ``notebook``, its
    ``version`` (the stamp's hash) and ``release`` ("" for today's, else the commit it was released in)."""

    number: str
    name: str
    notebook: dict
    version: str
    release: str = ""

    @functools.cached_property
    def units(self) -> list[Unit]:
        return units_of(self.notebook)

    @property
    def exercises(self) -> list[str]:
        return [e for unit in self.units for e in unit.exercises]

    def graded_shape(self) -> list:
        """What decides a verdict: the exercise cells (id, stub) and the checker cells' sources."""
        cells = self.notebook["cells"]
        return [[(cells[i].get("id"), source_of(cells[i])) for i in u.exercise_cells] + [source_of(cells[u.checker])]
                for u in self.units]


def current_lab(solution: Path) -> OfficialLab:
    """Today's lab of ``solutions/NN_topic.ipynb``, as ``make labs`` generates it."""
    notebook = json.loads(lab_text(solution))
    return OfficialLab(solution.name[:2], solution.name, notebook, recorded_hash(notebook))


@functools.lru_cache(maxsize=None)
def _releases(repo: str, name: str) -> tuple:
    """``(stamp, commit, date, text)`` of every committed version of ``labs/name``, newest first (empty
    without git or history)."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")

    def git(*args) -> str:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, env=env, timeout=60,
                              check=True).stdout

    try:
        log = git("log", "--format=%H %cs", "--", f"labs/{name}").split("\n")
    except (OSError, subprocess.SubprocessError):
        return ()
    found = []
    for line in filter(None, log):
        commit, date = line.split()
        try:
            text = git("show", f"{commit}:labs/{name}")
            found.append((recorded_hash(json.loads(text)), commit, date, text))
        except (OSError, subprocess.SubprocessError, ValueError, AttributeError):
            continue
    return tuple(found)


def lab_for(notebook: dict, today: OfficialLab, repo: Path) -> tuple[OfficialLab | None, str]:
    """The official lab to grade ``notebook`` (a student's copy of ``today``'s lab) against, and a note for
    the feedback; ``(None, why)`` when it is refused."""
    stamp = recorded_hash(notebook)
    if stamp is None:
        return today, "your notebook has no stamp (it was not copied from a generated lab): graded against today's lab"
    if stamp == today.version:
        return today, ""
    for version, commit, date, text in _releases(str(repo), today.name):
        if version != stamp:
            continue
        old = OfficialLab(today.number, today.name, json.loads(text), version, f"{commit[:10]} ({date})")
        if old.graded_shape() != today.graded_shape():
            return None, (f"refused: it is the lab released in commit {old.release}, whose exercise or checker "
                          f"cells differ from today's; move your exercise cells into a fresh copy "
                          f"(`python -m course_lib workspace --fresh {today.number}`) and submit that")
        return old, f"your notebook is the lab released in commit {old.release}: graded against that version"
    return None, (f"refused: its stamp names no release of labs/{today.name} (not in this repository's "
                  f"history); submit your work in a copy of the lab `python -m course_lib workspace` gives")


def graded_cells(lab: OfficialLab, notebook: dict | None) -> tuple[list[tuple[int, str]], dict[int, str], list[str]]:
    """The code cells to run: ``[(index, source)]`` of the official lab with the student's exercise cells
    put in; ``{index: official stub}`` of those exercise cells; and notes for the feedback. ``notebook``
    None: the stubs (what the official lab itself gives). Tagged cells that no exercise depends on are not run."""
    cells = lab.notebook["cells"]
    theirs = [c for c in (notebook or {}).get("cells", []) if isinstance(c, dict) and c.get("cell_type") == "code"]
    by_id = {c.get("id"): c for c in reversed(theirs) if isinstance(c.get("id"), str)}
    run, stubs, notes = [], {}, []
    for index, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        source = source_of(cell)
        if is_exercise_cell(cell):
            stubs[index] = source
            names = defined_names(source)
            mine = by_id.get(cell.get("id"))
            if mine is None:
                mine = next((c for c in theirs if names and names <= defined_names(source_of(c))), None)
            if mine is None and notebook is not None:
                notes.append(f"no cell of yours defines {', '.join(sorted(names))}: graded as the stub")
            source = source if mine is None else source_of(mine)
        run.append((index, source))
    graded = [dict(cell, source=dict(run).get(index, source_of(cell))) for index, cell in enumerate(cells)]
    must_run = skip_problems(graded)
    independent = {i for i, cell in enumerate(cells) if SKIP_TAG in cell.get("metadata", {}).get("tags", [])
                   and i not in must_run}
    return [(i, s) for i, s in run if i not in independent], stubs, notes
