"""Run a notebook's code cells in order, as Jupyter would, and say what each did.

Inside a run's kernel (:mod:`course_lib.classroom.grading.sandbox`), the cells run in an IPython
shell (magics such as ``%load_ext course_lib`` and ``%%torchrun`` work; no history is kept). A cell
that raises does not stop the run, as in ``pytest --nbval-lax``: a later exercise is graded whatever
an earlier one did. Each cell writes two events, ``{"cell": i, "phase": "start"}`` and
``{"cell": i, "phase": "end", "error": "NameError: ..." or None}``, then ``{"done": true}``: how the
grader knows how long each cell took. The verdicts come from the run's judge, in a file of its own; each
says the cell it was asked from (:data:`~course_lib.classroom.checks.judge_client.RUNNING`).
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from course_lib.classroom.checks import judge_client
from course_lib.classroom.checks.exercise import CappedOutput

ERROR_LIMIT = 300
"""Characters of a cell's error an event keeps."""
OUTPUT_LIMIT = 4 << 20
"""Characters of printed output a run keeps; the rest is dropped (a print loop then only costs time)."""


class _KeepNothing(dict):
    """A mapping that stores nothing: IPython 9 keeps every string a cell prints in
    ``history_manager.outputs`` until the cell ends -- a print loop would fill the memory."""

    def __missing__(self, key):
        return []


def run_cells(cells: Sequence[tuple[int, str]], write: Callable[[dict], None]) -> None:
    """Run ``[(notebook cell index, source), ...]`` in one IPython shell, writing each cell's events; what the
    cells print goes to ``sys.stdout`` up to :data:`OUTPUT_LIMIT` characters."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "nocolor"
    sys.stdout = sys.stderr = CappedOutput(sys.stdout, OUTPUT_LIMIT)
    shell = InteractiveShell.instance(config=config)
    shell.history_manager.outputs = _KeepNothing()
    for index, source in cells:
        judge_client.RUNNING["cell"] = index  # the judge writes it into its record of a check asked now
        write({"cell": index, "phase": "start"})
        result = shell.run_cell(source, store_history=False)
        error = result.error_before_exec or result.error_in_exec
        line = None if error is None else f"{type(error).__name__}: {error}"
        write({"cell": index, "phase": "end", "error": line if line is None else line[:ERROR_LIMIT]})
    write({"done": True})
