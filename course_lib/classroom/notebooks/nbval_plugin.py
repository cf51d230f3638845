"""A pytest plugin: one ``pytest --nbval`` run checks ``solutions/`` strictly and ``labs/`` laxly.

``make test`` runs the unit tests, the solution notebooks (every stored output must match) and
the student notebooks (they must run top to bottom with the exercises unsolved; their outputs
are not stored, so only cells marked ``# NBVAL_CHECK_OUTPUT`` are compared, as
``--nbval-lax`` would) in a single pytest session, so that ``pytest-xdist`` keeps both cores
busy across all three instead of idling at the end of each. Load it with
``pytest -p course_lib.classroom.notebooks.nbval_plugin``; notebooks in a folder named ``labs`` get the lax treatment.
"""

from __future__ import annotations

from pathlib import Path

LAX_FOLDER = "labs"


def _is_lab_cell(item) -> bool:
    return hasattr(item, "cell") and isinstance(getattr(item, "options", None), dict) \
        and Path(str(item.fspath)).parent.name == LAX_FOLDER


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if _is_lab_cell(item):
            item.options["check"] = "NBVAL_CHECK_OUTPUT" in "".join(item.cell.source)
