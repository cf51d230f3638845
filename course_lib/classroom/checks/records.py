"""The grading record: each verdict appended as one JSON line to the file :data:`VERDICTS_ENV` names.

``python -m course_lib grade`` sets the variable for the kernel it runs; without it nothing is written. The
judge writes the records of the checks it runs (:mod:`~course_lib.classroom.checks.judge`), to the file it was
handed already open (:data:`VERDICTS_FD_ENV`): by its kernel in a notebook, and under ``grade`` by the
sandbox, a file of its own that the kernel never holds (:mod:`course_lib.classroom.grading.sandbox`). A
process where the student's code may run drops the file first (:func:`forget`).
"""

from __future__ import annotations

import json
import os

VERDICTS_ENV = "COURSE_VERDICTS"
VERDICTS_FD_ENV = "COURSE_VERDICTS_FD"
"""Set in the judge when it is handed the verdict file already open (a graded kernel cannot open it by name,
and under ``grade`` the judge's record file is one no student's process holds)."""

_SINK: dict = {}  # "file": the open record file of this process, once opened


def verdict_file():
    """The open file :data:`VERDICTS_ENV` names (opened on first use, kept open; or the one handed over,
    :data:`VERDICTS_FD_ENV`), or None."""
    if "file" not in _SINK:  # (after forget(): None for good)
        if os.environ.get(VERDICTS_FD_ENV, "").isdigit():
            fd = int(os.environ[VERDICTS_FD_ENV])
        elif os.environ.get(VERDICTS_ENV):
            fd = os.open(os.environ[VERDICTS_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        else:
            return None
        # closefd=False: the descriptor is closed once, by forget(), never again by a collected wrapper
        _SINK["file"] = os.fdopen(fd, "a", encoding="utf-8", buffering=1, closefd=False)
    return _SINK["file"]


def write_record(record: dict) -> None:
    """Append ``record`` as one JSON line to :func:`verdict_file`, if there is one."""
    sink = verdict_file()
    if sink is not None:
        sink.write(json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n")
        sink.flush()


def forget() -> None:
    """Drop the record file in this process (its descriptor closed: nothing written here is a record any more).
    A process forked from one that writes the records, where the student's code may run, calls it first."""
    for name in (VERDICTS_FD_ENV, VERDICTS_ENV):
        os.environ.pop(name, None)
    sink = _SINK.pop("file", None)
    if sink is not None:
        try:
            os.close(sink.fileno())
        except (OSError, ValueError):
            pass
    _SINK["file"] = None
