"""``python -m course_lib grade`` grades every exercise of every lab: one student who submits the eleven solution
notebooks gets every exercise in grades.csv, passed, inside the sandbox (Lab 10's DeepSpeed included).

The exercises are read from the solution notebooks themselves (the registered functions their ``### BEGIN
SOLUTION`` cells define), not from what the grader found: an exercise whose checker cell the grader cannot match (two checkers
of one name, once) is then a missing row, and a lab that cannot run in the sandbox a failed one. One grading of
the whole course: the most expensive test of the suite after the notebooks themselves (3.5 to 6 minutes on 2
cores shared with other work), which is why it checks everything of it in one run.
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


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_the_solutions_of_every_lab_pass_every_exercise_in_the_sandbox(tmp_path):
    assert len(SOLUTIONS) == 12
    student = tmp_path / "submissions" / "sol"
    student.mkdir(parents=True)
    for path in SOLUTIONS:
        shutil.copy(path, student / path.name)
    lines: list[str] = []
    grade_class(tmp_path / "submissions", tmp_path / "grades", solutions=ROOT / "solutions", log=lines.append)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "grades" / "grades.csv").read_text(encoding="utf-8"))))

    expected = {path.name[:2]: exercises_of(path) for path in SOLUTIONS}
    graded = {lab: {r["exercise"] for r in rows if r["lab"] == lab} for lab in expected}
    assert graded == expected, lines
    failed = [(r["lab"], r["exercise"], r["hint"]) for r in rows if r["passed"] != "true"]
    assert not failed, failed
    assert len(rows) == sum(map(len, expected.values())) >= 43
    # a rank exercise's evidence is what ran on its ranks, not "0 calls"
    evidence = {r["exercise"]: r["evidence"] for r in rows}
    calls = re.match(r"(\d+) calls; ranks 4:", evidence["mlp_sharded_state_dict"])  # 8 per case the checker draws
    assert calls and int(calls.group(1)) % 8 == 0 < int(calls.group(1)), evidence["mlp_sharded_state_dict"]
    assert "ranks 2,3,4" in evidence["my_ring_all_reduce"]
    assert not any(line.startswith("not graded") for line in lines), lines
    # the review answers in prose go to the instructor, verbatim, in their own column (no checker grades them)
    prose = {r["exercise"]: r["prose"] for r in rows if r["prose"]}
    assert set(prose) == {"my_conclusions", "my_answers_07", "my_answers_09", "my_answers_10", "my_answers_11"}, prose
    assert prose["my_answers_07"].startswith("why_bf16_needs_no_loss_scaler: "), prose["my_answers_07"]
