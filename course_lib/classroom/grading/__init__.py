"""``python -m course_lib grade SUBMISSIONS --out DIR``: grade a class's notebooks against the official checkers.

For each student (a folder or zip in ``SUBMISSIONS``) and each lab, only the student's exercise cells
are taken and put into a fresh copy of the official lab, which runs in a fenced, limited kernel
with a time limit per exercise; each checker's structured verdict (pass/fail, hint, evidence) is
collected into a gradebook. Nothing is written outside ``DIR``: ``DIR/grades.csv``,
``DIR/totals.csv``, ``DIR/feedback/STUDENT.md`` (and the ledger of what it wrote, so a re-run
replaces only its own files); while it runs, every student runs in a folder of ``DIR/.work/``,
removed at the end.

======================  ==========================================================================
:mod:`.inputs`          the command's labs and folders checked (one-line errors)
:mod:`.submissions`     the students' folders and zips, and the notebook of each lab in them
:mod:`.official`        the official lab (today's, or the release a stamp names), its units, the run
:mod:`.sandbox`         the zygote and the fenced, limited kernel each run gets
:mod:`.landlock`        Linux Landlock: what a run may read, write and signal
:mod:`.seccomp`         Linux seccomp: a checked rank's student process opens no socket
:mod:`.cgroups`         as root, a run's control group: its processes and their memory capped, killed whole
:mod:`.driver`          the cells run in an IPython shell, each one's events written
:mod:`.grader`          one student's lab: timed per exercise, re-run past a hang, verdicts collected
:mod:`.gradebook`       grades.csv, totals.csv, the feedback pages, the summary table
======================  ==========================================================================

    python -m course_lib grade submissions/ --out grades/              # every lab
    python -m course_lib grade submissions/ --labs 01 03 --out grades/ # some labs
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path

from course_lib import rules

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MEMORY_GIB = 8.0
_WORK = ".work"
_WORK_MARK = ".course_grade_work"


def _remove_tree(path: Path) -> None:
    """Remove a run's folder whatever modes the student's code left on it."""
    def unlock(function, name, _exc):
        os.chmod(os.path.dirname(name), stat.S_IRWXU)
        if os.path.isdir(name) and not os.path.islink(name):
            os.chmod(name, stat.S_IRWXU)
        function(name)

    if path.exists():
        shutil.rmtree(path, onerror=unlock)


def _work_folder(out: Path) -> Path:
    """``out/.work``, fresh: a leftover of an interrupted run of this command is removed, anything else refused."""
    from course_lib.safe_files import OutputPathError

    work = out / _WORK
    if work.exists():
        if not (work / _WORK_MARK).is_file():
            raise OutputPathError(f"--out {out}: {work} was not made by this command; move it away or choose "
                                  f"another folder")
        _remove_tree(work)
    work.mkdir()
    (work / _WORK_MARK).write_text("the grader's working folder, removed when it ends\n")
    return work


def _check_owned(out: Path, names, ledger) -> None:
    from course_lib.safe_files import OutputPathError

    for name in names:
        if (out / name).exists() and not ledger.is_own(name):
            raise OutputPathError(f"--out {out}: {out / name} exists and was not written by this command (or was "
                                  f"edited since); move it away or choose another folder")


def grade_class(submissions: Path, out: Path, labs=None, timeout: float = DEFAULT_TIMEOUT_S,
                memory_gib: float = DEFAULT_MEMORY_GIB, solutions: Path = Path("solutions"), log=print,
                tasks_max: int | None = None) -> list:
    """Grade every student of ``submissions`` on ``labs`` (two-digit numbers; default all), write the gradebook
    to ``out``, and return the :class:`~course_lib.classroom.grading.gradebook.LabGrade` list. ``tasks_max``: the
    processes and threads one run may have at once (default :data:`~course_lib.classroom.grading.cgroups.PIDS_MAX`,
    enough for every lab; a test of a fork bomb's containment lowers it)."""
    from course_lib.classroom.grading import gradebook, inputs
    from course_lib.classroom.grading.cgroups import PIDS_MAX
    from course_lib.classroom.grading.grader import Outcome, grade_lab
    from course_lib.classroom.grading.official import current_lab, graded_cells, lab_for
    from course_lib.classroom.grading.sandbox import Sandbox
    from course_lib.classroom.grading.submissions import find_students
    from course_lib.classroom.notebooks.generator import solution_notebooks
    from course_lib.safe_files import OutputLedger, check_output_dir

    submissions, out = Path(submissions), Path(out)
    if not submissions.is_dir():
        raise rules.UsageError(f"SUBMISSIONS={submissions} is not a folder; give the folder that holds one folder or "
                               f".zip file per student")
    inputs.grading_folders(submissions, out)
    timeout = rules.timeout_seconds("--timeout", timeout)
    memory = int(rules.number("--memory", memory_gib, 0.25) * 2 ** 30)
    sources = {path.name[:2]: path for path in solution_notebooks(Path(solutions))}
    chosen = sorted({inputs.lab_number("--labs", n, sorted(sources)) for n in labs} if labs else sources)
    students, skipped = find_students(submissions)
    names = gradebook.feedback_names([s.student for s in students])
    out = check_output_dir(out)
    ledger = OutputLedger(out)
    _check_owned(out, ["grades.csv", "totals.csv", *(f"feedback/{n}" for n in names.values())], ledger)

    official = {n: current_lab(sources[n]) for n in chosen}
    repo = Path(solutions).resolve().parent
    for line in skipped:
        log(line)
    grades = []
    work = _work_folder(out)
    sandbox = None
    try:
        deepspeed = any("course_lib.deepspeed.engine" in json.dumps(official[n].notebook["cells"]) for n in chosen)
        sandbox = Sandbox(work, deny=[Path(solutions), submissions, out], memory_bytes=memory, deepspeed=deepspeed,
                          tasks_max=tasks_max or PIDS_MAX)
        for sub in students:
            for number in chosen:
                started = time.monotonic()
                today = official[number]
                notebook, problem = sub.notebook(number, today.name)
                lab, note = (None, problem) if notebook is None else lab_for(notebook, today, repo)
                if lab is None:
                    outcomes, notes = [Outcome(e, False, note) for e in today.exercises], []
                else:
                    cells, stubs, notes = graded_cells(lab, notebook)
                    run_dir = work / "runs" / f"{names[sub.student][:-3]}-{number}"
                    run_dir.mkdir(parents=True)
                    outcomes, more = grade_lab(sandbox, lab, cells, stubs, run_dir, timeout)
                    notes = [note] * bool(note) + notes + more
                    _remove_tree(run_dir)
                grades.append(gradebook.LabGrade(sub.student, number, today.name, outcomes, notes))
                passed = sum(o.passed for o in outcomes)
                log(f"{sub.student} lab {number}: {passed}/{len(outcomes)} passed "
                    f"({time.monotonic() - started:.1f} s)")
    finally:
        if sandbox is not None:
            sandbox.close()
        _remove_tree(work)

    files = gradebook.files(grades)
    for name in [n for n in ledger.hashes if n.startswith("feedback/") and n not in files]:
        if ledger.is_own(name):  # a student of an earlier grading who is not in this class
            (out / name).unlink()
        del ledger.hashes[name]
    ledger.write(files)
    log(gradebook.summary(grades))
    if sandbox is not None and sandbox.landlock == 0:
        log("warning: Landlock is not available here (Linux >= 5.13 has it): the students' code could read and "
            "write what you can")
    if os.geteuid() == 0 and sandbox is not None and "pids" not in sandbox.cgroups:
        log("warning: grading as root without a writable pids cgroup: the kernel does not apply the process limit "
            "to root, so only the time limit stops a fork bomb; grade as an ordinary user")
    log(f"wrote {out / 'grades.csv'}, {out / 'totals.csv'} and {len(names)} feedback pages in {out / 'feedback'}")
    return grades


def add_arguments(parser) -> None:
    parser.add_argument("submissions", type=Path, metavar="SUBMISSIONS",
                        help="a folder with one folder or .zip file of lab notebooks per student")
    parser.add_argument("--out", type=Path, required=True, help="the folder for grades.csv, totals.csv, feedback/")
    parser.add_argument("--labs", nargs="+", metavar="NN", help="the labs to grade (default: every lab)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds one exercise (its cells and its checker) or one other cell may take "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--memory", type=float, default=DEFAULT_MEMORY_GIB,
                        help=f"GiB of address space per process of a student's run, beyond what the course's "
                             f"imports map, and as root of memory for the run's processes together "
                             f"(default {DEFAULT_MEMORY_GIB:g})")
    parser.add_argument("--solutions", type=Path, default=Path("solutions"),
                        help="the solution notebooks the official labs are generated from (default: solutions)")


def run(args) -> int:
    grade_class(args.submissions, args.out, args.labs, args.timeout, args.memory, args.solutions,
                log=lambda line: print(line, file=sys.stdout, flush=True))
    return 0
