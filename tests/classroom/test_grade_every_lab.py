"""``python -m course_lib grade`` grades every exercise of every lab: one student who submits the solution
notebooks gets every exercise in grades.csv, passed, inside the sandbox (Lab 10's DeepSpeed included).

The exercises are read from the solution notebooks themselves (the registered functions their ``### BEGIN
SOLUTION`` cells define), not from what the grader found: an exercise whose checker cell the grader cannot match (two checkers
of one name, once) is then a missing row, and a lab that cannot run in the sandbox a failed one. The whole course
is graded in two gradings of about the same CPU (:data:`GROUPS`), this file's and ``test_grade_every_lab_more.py``'s,
which ``make test``'s two workers (``--dist loadfile``: one file each) can run at once; together the most expensive
tests of the suite after the notebooks themselves, which is why each checks everything of its labs in one run.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from course_lib.classroom.grading import grade_class, landlock

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
GROUPS = (("01", "05", "07", "10", "11"), ("00", "02", "03", "04", "06", "08", "09"))
"""The labs this file grades, and those ``test_grade_every_lab_more.py`` grades. CPU of each lab's grading (one
quiet 2-core machine, 2026-12-05): Lab 10 ~18 s and the zygote's DeepSpeed ops ~7 s (only the first group's zygote
loads them), 05 ~17, 09 ~14, 02 ~8, 03 and 06 ~6, 00 04 07 ~4, 11 08 01 ~3: ~52 s and ~48 s."""
PROSE = {"my_conclusions", "my_answers_07", "my_answers_09", "my_answers_10", "my_answers_11"}
"""The review exercises whose answers in prose go to the instructor."""


ALIASES = {"CopyToTensorParallelRegion": "f_and_g", "ReduceFromTensorParallelRegion": "f_and_g",
           "predict_elements_sent": "predict_collectives"}  # as tests/classroom/checks/test_proofs.py


def exercises_of(path: Path) -> set[str]:
    """The exercises of one solution notebook, read from its solution cells: each function or class a
    ``### BEGIN SOLUTION`` cell defines that the reference registry names (a review cell: ``my_answers_NN``)."""
    from course_lib.classroom.checks.references import REFERENCES

    found = set()
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "### BEGIN SOLUTION" in source:
            names = [ALIASES.get(n, n) for n in re.findall(r"^(?:def|class) (\w+)", source, re.M)]
            keys = {n for n in names if n in REFERENCES} or {f"my_answers_{path.name[:2]}"} & set(REFERENCES)
            assert keys, f"{path.name}: a solution cell defining {names} is no exercise of the registry"
            found |= keys
    return found


def test_the_groups_hold_every_lab_once():
    assert len(SOLUTIONS) == 12
    assert sorted(n for group in GROUPS for n in group) == [path.name[:2] for path in SOLUTIONS]
    assert sum(len(exercises_of(path)) for path in SOLUTIONS) >= 43


def grade_solutions(tmp_path: Path, labs) -> tuple[dict, dict]:
    """The solutions submitted as one student, ``labs`` graded: every exercise of each (read from its solution
    notebook) in grades.csv and passed, none "not graded", the prose in its own column. Returns each exercise's
    evidence and its prose."""
    student = tmp_path / "submissions" / "sol"
    student.mkdir(parents=True)
    for path in SOLUTIONS:
        shutil.copy(path, student / path.name)
    lines: list[str] = []
    grade_class(tmp_path / "submissions", tmp_path / "grades", labs=list(labs), solutions=ROOT / "solutions",
                log=lines.append)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "grades" / "grades.csv").read_text(encoding="utf-8"))))

    expected = {path.name[:2]: exercises_of(path) for path in SOLUTIONS if path.name[:2] in labs}
    assert sorted(expected) == sorted(labs)
    graded = {lab: {r["exercise"] for r in rows if r["lab"] == lab} for lab in expected}
    assert graded == expected, lines
    failed = [(r["lab"], r["exercise"], r["hint"]) for r in rows if r["passed"] != "true"]
    assert not failed, failed
    assert len(rows) == sum(map(len, expected.values()))
    assert not any(line.startswith("not graded") for line in lines), lines
    # the review answers in prose go to the instructor, verbatim, in their own column (no checker grades them)
    prose = {r["exercise"]: r["prose"] for r in rows if r["prose"]}
    assert set(prose) == PROSE & set().union(*expected.values()), prose
    return {r["exercise"]: r["evidence"] for r in rows}, prose


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_the_solutions_of_every_lab_pass_every_exercise_in_the_sandbox(tmp_path):
    """The first group (:data:`GROUPS`); the second is ``test_grade_every_lab_more.py``'s."""
    evidence, prose = grade_solutions(tmp_path, GROUPS[0])
    assert prose["my_answers_07"].startswith("why_bf16_needs_no_loss_scaler: "), prose["my_answers_07"]
    # Lab 10: one launch of the drawn cases serves both wire exercises (the judge keeps what zero3_wire's check
    # drew and launched), so reduce_buckets' check launches no ranks of its own
    assert re.fullmatch(r"\d+ calls; ranks 4: .*", evidence["zero3_wire"]), evidence["zero3_wire"]
    assert re.fullmatch(r"\d+ calls", evidence["reduce_buckets"]), evidence["reduce_buckets"]
