"""Grade one student's lab: run it in the sandbox, time each exercise, collect each checker's verdict.

The lab runs once, top to bottom, in one kernel (:mod:`course_lib.classroom.grading.sandbox`), as the
student's own notebook would. Every unit (an exercise's cells and its checker cell,
:func:`course_lib.classroom.grading.official.units_of`) and every other cell has ``timeout`` seconds
from the moment it starts. One that runs over, or during which the kernel dies, costs only itself:
the kernel is killed whole, that unit's exercises are graded "timed out" (or "crashed: ..."), and the
lab runs again from the top with that unit's exercise cells put back to the official stubs (another
cell that hangs is left out), so the later exercises are still graded -- unless every exercise already
has its verdict (a hang in the last unit): then nothing is run again. Each run resolves one unit,
so a lab runs at most once more than it has units.

A verdict counts only when the run's judge wrote it (:mod:`course_lib.classroom.grading.sandbox`: a file
no process of the student's holds) for a check asked from the official checker cell of its exercise, and
the first one counts: a checker the student calls from their own cell decides nothing, a verdict record
the student's code writes decides nothing, and a re-run does not change what an earlier run found.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.classroom.grading.official import OfficialLab, defined_names
from course_lib.classroom.grading.sandbox import JUDGE_RECORDS
from course_lib.launch.process_tree import describe_exit

FORGED = ("a verdict record your code wrote (not the judge) was ignored: a grade comes only from the judge, "
          "which runs the checkers where your code cannot reach")
POLL_S = 0.05
START_TIMEOUT_S = 60.0
"""How long a kernel may take to reach its first cell."""


@dataclass(frozen=True)
class Outcome:
    """One exercise's grade: ``passed``, the ``hint`` (why not), the checker's ``evidence``, and the student's
    answers in ``prose`` (question key -> text) for the instructor to read: no checker passes them."""

    exercise: str
    passed: bool
    hint: str
    evidence: dict = field(default_factory=dict)
    prose: dict = field(default_factory=dict)


@dataclass
class _Run:
    """What one run of the lab did: its events in order and how it ended (``done``, ``timeout``, ``exit``)."""

    events: list = field(default_factory=list)
    ended: str = "exit"
    status: int | None = None

    def current(self) -> int | None:
        """The cell that started last and did not end."""
        running = None
        for event in self.events:
            if "cell" in event:
                running = event["cell"] if event.get("phase") == "start" else None
        return running


class _Events:
    """The run's events file, read as it grows: complete JSON lines that are objects (anything else the
    student's code may have written to it is skipped)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out


def _watch(sandbox, pid: int, events: _Events, clock_of, timeout: float) -> _Run:
    """Follow a run until it is done, runs over a clock, or ends; the kernel is stopped in every case."""
    run, clock, started = _Run(), None, time.monotonic()
    try:
        while True:
            for event in events.new():
                run.events.append(event)
                if event.get("done") is True:
                    run.ended = "done"
                    return run
                if event.get("phase") == "start" and clock_of(event.get("cell")) != clock:
                    clock, started = clock_of(event.get("cell")), time.monotonic()
            status = sandbox.poll(pid)
            if status is not None:
                run.events += events.new()
                run.status = status
                return run
            if time.monotonic() - started > (timeout if clock is not None else START_TIMEOUT_S):
                run.ended = "timeout"
                return run
            time.sleep(POLL_S)
    finally:
        sandbox.stop(pid)


class _Progress:
    """What the runs of one lab have found so far, and what the next run leaves out."""

    def __init__(self, lab: OfficialLab, stubs: dict[int, str]):
        self.lab, self.stubs = lab, stubs
        self.unit_of = {i: u for u in lab.units for i in u.cells}
        self.found: dict[str, Outcome] = {}
        self.checker_errors: dict[str, str] = {}
        self.first_error: str | None = None  # the first error of a cell of the lab's own (not an exercise's)
        self.notes: list[str] = []
        self.put_back: set[int] = set()  # exercise cells run as the official stub
        self.left_out: set[int] = set()  # other cells not run again

    def cells(self, cells: list[tuple[int, str]]) -> list[tuple[int, str]]:
        return [(i, self.stubs[i] if i in self.put_back else s) for i, s in cells if i not in self.left_out]

    def collect(self, events: list[dict], judged: list[dict], sources: dict[int, str]) -> None:
        """Take the judge's verdicts (``judged``) asked from their own checker cell, and the errors of the
        student's cells (``events``). A verdict in the kernel's events was written by the student's code: it
        counts for nothing, and the feedback says so."""
        for event in events:
            if "cell" in event:
                if event.get("phase") == "end" and event.get("error"):
                    self._cell_error(event["cell"], event["error"], sources)
            elif "verdict" in event and FORGED not in self.notes:
                self.notes.append(FORGED)
        for record in judged:
            verdict, cell = record.get("verdict"), record.get("cell")
            unit = self.unit_of.get(cell) if isinstance(cell, int) else None
            if not isinstance(verdict, dict) or unit is None or cell != unit.checker:
                continue
            exercise = verdict.get("exercise")
            if exercise not in unit.exercises or exercise in self.found:
                continue
            evidence = verdict.get("evidence") if isinstance(verdict.get("evidence"), dict) else {}
            prose = verdict.get("prose") if isinstance(verdict.get("prose"), dict) else {}
            self.found[exercise] = Outcome(exercise, verdict.get("ok") is True, str(verdict.get("hint") or ""),
                                           evidence, {str(k): str(v) for k, v in prose.items()})

    def _cell_error(self, index: int, error: str, sources: dict[int, str]) -> None:
        unit = self.unit_of.get(index)
        if unit is not None and index == unit.checker:
            # the first real cause: a NameError in a checker often only follows from an earlier cell's error
            cause = f"cell {self.first_error} first, then the checker cell raised {error}" if self.first_error \
                else f"the checker cell raised {error}"
            for exercise in unit.exercises:
                self.checker_errors.setdefault(exercise, cause)
        elif index not in self.stubs:
            if self.first_error is None:
                self.first_error = f"{index} of the lab (not an exercise) raised {error}"
                self.notes.append(f"cell {self.first_error}")
        elif index in self.stubs and index not in self.put_back and sources.get(index) != self.stubs[index]:
            note = f"your cell defining {', '.join(sorted(defined_names(self.stubs[index])))} raised {error}"
            if note not in self.notes:
                self.notes.append(note)

    def blame(self, run: _Run, timeout: float, output: Path) -> bool:
        """Grade what a run that did not finish was running, and leave it out of the next run; False when
        there is nothing to leave out (the kernel never reached a cell)."""
        where = run.current()
        if where is None:
            reason = "the grading kernel did not start" if run.ended == "timeout" else \
                f"the grading kernel {_ended(run.status)} before the first cell"
            self.notes.append(f"not graded: {reason} ({_last_line(output)})")
            return False
        unit = self.unit_of.get(where)
        what = "its cells and its checker" if unit else f"cell {where} of the lab (not an exercise)"
        what = (f"timed out: {what} ran over {timeout:g} s" if run.ended == "timeout"
                else f"crashed: the notebook's process {_ended(run.status)} while {what} ran")
        if unit is None:
            self.notes.append(f"{what} with your code in the notebook; the lab was run again without that cell")
            self.left_out.add(where)
            if self.first_error is None:  # a checker that then misses the cell's names raises NameError: say why
                ran = f"ran over {timeout:g} s" if run.ended == "timeout" else \
                    f"crashed (the process {_ended(run.status)})"
                self.first_error = f"{where} of the lab (not an exercise) {ran} and was left out of the run again"
            return True
        for exercise in unit.exercises:
            self.found.setdefault(exercise, Outcome(exercise, False, what))
        self.put_back.update(unit.exercise_cells)
        return True

    def complete(self) -> bool:
        """Whether every exercise of the lab has its verdict: another run could change none (the first counts)."""
        return all(e in self.found for e in self.lab.exercises)

    def outcomes(self) -> list[Outcome]:
        found = [self.found.get(e) or Outcome(e, False, _no_verdict(e, self.checker_errors)) for e in self.lab.exercises]
        return [_after_put_back(o, self.found) for o in found]


def grade_lab(sandbox, lab: OfficialLab, cells: list[tuple[int, str]], stubs: dict[int, str], run_dir: Path,
              timeout: float) -> tuple[list[Outcome], list[str]]:
    """Run ``cells`` (the graded notebook's code cells) in ``run_dir``; every exercise's outcome, and notes."""
    progress = _Progress(lab, stubs)
    for _ in range(len(lab.units) + len(cells) + 1):  # each run that does not finish leaves one more out
        todo = progress.cells(cells)
        (run_dir / "cells.json").write_text(json.dumps(todo), encoding="utf-8")
        (run_dir / "events.jsonl").write_bytes(b"")
        (run_dir / JUDGE_RECORDS).write_bytes(b"")
        pid = sandbox.start(run_dir / "cells.json", run_dir)
        run = _watch(sandbox, pid, _Events(run_dir / "events.jsonl"), lambda i: progress.unit_of.get(i, i), timeout)
        progress.collect(run.events, _Events(run_dir / JUDGE_RECORDS).new(), dict(todo))
        if run.ended == "done" or not progress.blame(run, timeout, run_dir / "output.txt") or progress.complete():
            break
    return progress.outcomes(), progress.notes


def _after_put_back(outcome: Outcome, found: dict) -> Outcome:
    """An exercise that calls one put back as its stub (it crashed or timed out) says so: its checker saw the stub
    ("not attempted yet: write merge (Exercise 1), which ring_attention_forward calls"), not the student's cell."""
    for name, other in found.items():
        why = other.hint.split(":")[0]
        if (name != outcome.exercise and why in ("crashed", "timed out") and not outcome.passed
                and outcome.hint.startswith(f"not attempted yet: write {name} ")):
            return Outcome(outcome.exercise, False, f"graded with the stub of {name}, which {why}: {outcome.hint}",
                           outcome.evidence, outcome.prose)
    return outcome


def _ended(status: int | None) -> str:
    """How the kernel ended: ``"exited with code 3"``, ``"was killed by signal SIGSEGV (...)"``."""
    return f"exited with code {status}" if status is not None and status >= 0 else describe_exit(status)


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "it printed nothing"


def _no_verdict(exercise: str, checker_errors: dict) -> str:
    if exercise in checker_errors:
        return f"no verdict: {checker_errors[exercise]}"
    return "no verdict: the checker cell did not run to its verdict"
