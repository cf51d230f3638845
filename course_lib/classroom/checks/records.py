"""The grading record: each verdict appended as one JSON line to the file :data:`VERDICTS_ENV` names.

``python -m course_lib grade`` sets the variable for the kernel it runs; without it nothing is written. The
judge writes the records of the checks it runs (:mod:`~course_lib.classroom.checks.judge`), to the file its
kernel hands it already open (:data:`VERDICTS_FD_ENV`: a graded kernel cannot open the file by name, see
:mod:`course_lib.classroom.grading.sandbox`).
"""

from __future__ import annotations

import functools
import json
import os

VERDICTS_ENV = "COURSE_VERDICTS"


@functools.lru_cache(maxsize=None)
def _open_sink(path: str):
    return open(path, "a", encoding="utf-8", buffering=1)


VERDICTS_FD_ENV = "COURSE_VERDICTS_FD"
"""Set in the judge when its kernel hands it the verdict file already open (a graded kernel cannot open it
by name: see :mod:`course_lib.classroom.grading.sandbox`)."""


@functools.lru_cache(maxsize=None)
def _inherited_sink(fd: int):
    return os.fdopen(fd, "a", encoding="utf-8", buffering=1, closefd=False)


def verdict_file():
    """The open file :data:`VERDICTS_ENV` names (opened on first use, kept open; or the one the kernel handed
    the judge, :data:`VERDICTS_FD_ENV`), or None."""
    if os.environ.get(VERDICTS_FD_ENV, "").isdigit():
        return _inherited_sink(int(os.environ[VERDICTS_FD_ENV]))
    path = os.environ.get(VERDICTS_ENV)
    return _open_sink(path) if path else None


def write_record(record: dict) -> None:
    """Append ``record`` as one JSON line to :func:`verdict_file`, if there is one."""
    sink = verdict_file()
    if sink is not None:
        sink.write(json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n")
        sink.flush()
