"""The ``grade`` command's own inputs checked, each a one-line error naming the flag and a fix:
the labs it is asked for, and its two folders kept apart."""

from __future__ import annotations

import os
from course_lib.rules import UsageError


def lab_number(name: str, value, labs) -> str:
    """A lab named by its two-digit number, one of ``labs`` (``"3"`` reads as ``"03"``)."""
    text = str(value).strip()
    if text.isdigit() and text.zfill(2) in labs:
        return text.zfill(2)
    raise UsageError(f"{name}={value!r} names no lab; give the two-digit number of one of {', '.join(labs)}")


def grading_folders(submissions, out) -> None:
    """The grading output ``out`` and the ``submissions`` folder are apart (neither inside the other):
    the grader reads every folder of the one and writes the other."""
    sub, dest = os.path.realpath(submissions), os.path.realpath(out)
    if dest == sub or dest.startswith(sub + os.sep):
        raise UsageError(f"--out={out} is inside SUBMISSIONS={submissions}, where it would be read as a student's "
                         f"submission; write the grades to a folder outside it")
    if sub.startswith(dest + os.sep):
        raise UsageError(f"SUBMISSIONS={submissions} is inside --out={out}, the grader's own folder; "
                         f"keep the submissions outside it")
