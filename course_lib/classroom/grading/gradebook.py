"""The gradebook: ``grades.csv``, ``totals.csv``, one feedback page per student, and the summary an
instructor reads before class.

``grades.csv`` has one row per student, lab and exercise: ``student``, ``lab``, ``exercise``,
``passed`` (``true``/``false``), ``hint`` (the checker's hint, or why there is no verdict: "not
submitted", "timed out: ...", "crashed: ...", "refused: ...") and ``evidence`` (what the student's
code did under the checker, in words: calls, and on ranks the ops, groups and bytes) and ``prose``
(a review exercise's answers in free prose, ``key: text`` joined by `` | ``: for the instructor to read;
``passed`` says only that they were written, never what they say). Rows come in
the order of the students' names and of the lab's exercises, and nothing in them depends on when or
where grading ran, so grading the same class again writes the same grades and hints (the evidence may
count other calls: the checkers draw their cases per run).
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from dataclasses import dataclass, field

from course_lib.classroom.grading.grader import Outcome

COLUMNS = ("student", "lab", "exercise", "passed", "hint", "evidence", "prose")
_SUMMARY_HINT = 60


@dataclass(frozen=True)
class LabGrade:
    """One student's lab: the lab's ``number`` and file ``name``, each exercise's outcome, and notes."""

    student: str
    number: str
    name: str
    outcomes: list
    notes: list = field(default_factory=list)


def evidence_line(evidence: dict) -> str:
    """``"36 calls; ranks 2,3,4: 160 recv, 160 send on world; 1296 B sent"`` (empty without evidence)."""
    parts = []
    if evidence.get("calls") is not None:
        parts.append(f"{evidence['calls']} call{'' if evidence['calls'] == 1 else 's'}")
    if evidence.get("ranks"):
        groups = list(evidence.get("groups") or [])
        shown = ", ".join(groups[:3]) + (f" and {len(groups) - 3} more groups" if len(groups) > 3 else "")
        ops = ", ".join(f"{n} {op}" for op, n in (evidence.get("ops") or {}).items()) or "no ops"
        parts.append(f"ranks {','.join(map(str, evidence['ranks']))}: {ops}" + (f" on {shown}" if shown else ""))
        parts.append(f"{evidence.get('bytes', 0)} B sent")
    return "; ".join(parts)


def prose_line(prose: dict) -> str:
    """``"why_append_eod: Samples run over ... | split_cuts: ..."``: answers in prose on one line."""
    return " | ".join(f"{key}: {' '.join(text.split())}" for key, text in prose.items())


def _csv(rows) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows(rows)
    return buffer.getvalue()


def feedback_names(students: list[str]) -> dict[str, str]:
    """``{student: file name under feedback/}``: the name with anything but letters, digits, ``.``, ``_``
    and ``-`` replaced, made unique."""
    names, taken = {}, set()
    for student in students:
        base = re.sub(r"[^A-Za-z0-9._-]", "_", student).strip(".") or "student"
        name, n = f"{base}.md", 2
        while name.lower() in taken:
            name, n = f"{base}-{n}.md", n + 1
        taken.add(name.lower())
        names[student] = name
    return names


def _feedback(student: str, grades: list[LabGrade]) -> str:
    lines = [f"# Feedback for {student}", ""]
    for grade in grades:
        passed = sum(o.passed for o in grade.outcomes)
        lines += [f"## Lab {grade.number} ({grade.name}): {passed} of {len(grade.outcomes)} passed", ""]
        for outcome in grade.outcomes:
            if outcome.passed:
                lines.append(f"- ✓ `{outcome.exercise}`")
                continue
            lines.append(f"- ✗ `{outcome.exercise}`: {outcome.hint}")
            if evidence_line(outcome.evidence):
                lines.append(f"  - what your code did under the checker: {evidence_line(outcome.evidence)}")
        prose = [(o.exercise, key, text) for o in grade.outcomes for key, text in o.prose.items()]
        if prose:  # the instructor reads them: ✓ above says they were written, not what they are worth
            lines += ["", "Your answers in prose (for your instructor to read; no checker grades them):", ""]
            lines += [f"- `{exercise}` / `{key}`:\n\n  > " + "\n  > ".join(text.strip().splitlines() or [""])
                      for exercise, key, text in prose]
        if grade.notes:
            lines += ["", "Notes:"] + [f"- {note}" for note in grade.notes]
        lines.append("")
    return "\n".join(lines)


def files(grades: list[LabGrade]) -> dict[str, str]:
    """``{file name under the output folder: text}``: grades.csv, totals.csv and feedback/STUDENT.md."""
    rows = [COLUMNS]
    totals = [("student", "lab", "passed", "exercises")]
    for g in grades:
        rows += [(g.student, g.number, o.exercise, "true" if o.passed else "false", o.hint, evidence_line(o.evidence),
                  prose_line(o.prose)) for o in g.outcomes]
        totals.append((g.student, g.number, sum(o.passed for o in g.outcomes), len(g.outcomes)))
    out = {"grades.csv": _csv(rows), "totals.csv": _csv(totals)}
    students = sorted({g.student for g in grades})
    for student, name in feedback_names(students).items():
        out[f"feedback/{name}"] = _feedback(student, [g for g in grades if g.student == student])
    return out


def summary(grades: list[LabGrade]) -> str:
    """Per exercise: how many students passed it, and the most common hint of those who did not."""
    by_exercise: dict[tuple, list[Outcome]] = {}
    for g in grades:
        for o in g.outcomes:
            by_exercise.setdefault((g.number, o.exercise), []).append(o)
    width = max([len(e) for _, e in by_exercise] + [8])
    lines = [f"{'lab':3}  {'exercise':{width}}  {'passed':>7}  most common hint"]
    for (number, exercise), outcomes in by_exercise.items():
        hints = Counter(o.hint for o in outcomes if not o.passed)
        common = ""
        if hints:
            hint, count = min(hints.items(), key=lambda item: (-item[1], item[0]))
            common = (hint if len(hint) <= _SUMMARY_HINT else hint[: _SUMMARY_HINT - 3] + "...") + f" ({count})"
        passed = f"{sum(o.passed for o in outcomes)}/{len(outcomes)}"
        lines.append(f"{number:3}  {exercise:{width}}  {passed:>7}  {common}")
    return "\n".join(lines)
