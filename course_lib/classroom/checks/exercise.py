"""Structured verdicts: what every checker returns, and how a grader collects them from a kernel.

A checker prints its verdict for the student ("✓ ..."; "✗ ..." and a hint; "not attempted yet") and
returns a :class:`Verdict`: ``ok``; ``exercise``, the name of the function the student writes (the key
of :mod:`~course_lib.classroom.checks.references`); ``hint``, what it printed (not what the student's code printed), on one line, when not ok;
and ``evidence``, plain JSON of what the student's code did while it was checked -- how often the
checker called it and, where it ran on ranks, the ops, groups and bytes it put on the wire (a
:class:`~course_lib.classroom.checks.wire.StudentTrace`). A Verdict is truthy when ok, so
``if check_x(fn):`` reads as before.

``@exercise("derive_dp")`` above a checker that prints its verdict and returns a bool makes it do
that. What it prints still goes to the notebook, unchanged (the labs' stored outputs stay as they
are), and is kept for the hint. The name is a literal (``"my_answers_{lab}"`` is formatted with the
checker's own arguments), so a grader finds which exercise a checker cell grades by reading the
checks' source, without importing them (:func:`checkers_in`).

When the environment names a file in :data:`VERDICTS_ENV`, each verdict is also appended to it as one
JSON line, ``{"verdict": {...}}`` (:func:`write_record`; the file is opened once per process and kept
open). That is how ``python -m course_lib grade`` collects them from the kernel it runs; without the
variable nothing is written.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import io
import json
import os
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.classroom.checks.records import VERDICTS_ENV, VERDICTS_FD_ENV, verdict_file, write_record  # noqa: F401
from course_lib.classroom.checks.wire import traced

HINT_LIMIT = 1000
"""Characters of a hint a verdict keeps (a student's answer can make a checker print a lot)."""
COPY_LIMIT = 64 << 10
"""Characters of a checker's printed text kept for its hint."""
_MARKS = ("✓", "✗")


@dataclass(frozen=True)
class Verdict:
    """One checker's verdict on one exercise: ``ok``, ``exercise`` (the name the student's function has),
    ``hint`` (the checker's printed text on one line when not ok, else ``""``) and ``evidence`` (plain
    JSON: ``calls``; with ranks also ``ranks``, ``ops``, ``groups``, ``bytes``). Truthy when ok."""

    ok: bool
    exercise: str
    hint: str = ""
    evidence: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok

    def as_json(self) -> dict:
        return {"ok": self.ok, "exercise": self.exercise, "hint": self.hint, "evidence": self.evidence}


def one_line(text: str, limit: int = HINT_LIMIT) -> str:
    """Printed verdict text as one line: its lines stripped of the verdict marks and joined."""
    parts = []
    for line in text.splitlines():
        line = line.strip()
        for mark in _MARKS:
            line = line.removeprefix(mark).strip()
        if line:
            parts.append(line)
    joined = " ".join(parts)
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


class CappedOutput(io.TextIOBase):
    """A text stream that passes on the first ``limit`` characters written to it and drops the rest."""

    def __init__(self, stream, limit: int):
        super().__init__()
        self._stream, self._left = stream, limit

    def write(self, text):
        if self._left > 0:
            self._stream.write(text[: self._left])
            self._left -= len(text)
        return len(text)

    def flush(self):
        self._stream.flush()


class _Tee(io.TextIOBase):
    """Writes to the stream it replaces, and keeps a copy (the first :data:`COPY_LIMIT` characters) of what
    the checker prints -- not of what the student's code prints while it runs (``trace.depth``)."""

    def __init__(self, stream, copy: io.StringIO, trace):
        super().__init__()
        self._stream, self._copy, self._trace = stream, CappedOutput(copy, COPY_LIMIT), trace

    def write(self, text):
        if not self._trace.depth:
            self._copy.write(text)
        return self._stream.write(text)

    def flush(self):
        self._stream.flush()

    def isatty(self):
        return self._stream.isatty()


def exercise(name: str, judged: bool = True):
    """Decorate a checker of exercise ``name`` (a literal; ``{arg}`` fields are filled with the checker's
    arguments): it returns a :class:`Verdict` instead of its bool, and writes it where
    :data:`VERDICTS_ENV` says."""

    def decorate(check):
        signature = inspect.signature(check)

        def exercise_of(*args, **kwargs) -> str:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return name.format(**bound.arguments)

        @functools.wraps(check)
        def checker(*args, **kwargs) -> Verdict:
            from course_lib.classroom.checks import judge_client

            if judged and judge_client.wanted():
                return _from_judge(checker, exercise_of(*args, **kwargs), args, kwargs)
            return _in_this_process(check, exercise_of(*args, **kwargs), args, kwargs)

        checker.exercise_of = exercise_of
        checker.__annotations__ = {**check.__annotations__, "return": Verdict}
        return checker

    return decorate


def _in_this_process(check, exercise_name: str, args, kwargs) -> Verdict:
    """Run the checker here (in the judge; or in the kernel for a checker that is not judged)."""
    printed = io.StringIO()
    with traced() as trace, contextlib.redirect_stdout(_Tee(sys.stdout, printed, trace)):
        ok = bool(check(*args, **kwargs))
    verdict = Verdict(ok, exercise_name, "" if ok else one_line(printed.getvalue()), trace.evidence())
    write_record({"verdict": verdict.as_json()})
    return verdict


def _from_judge(checker, exercise_name: str, args, kwargs) -> Verdict:
    """Ask the judge (:mod:`~course_lib.classroom.checks.judge`): its output is printed here as it comes,
    and it writes the grading record itself (also when the checker could not finish)."""
    from course_lib.classroom.checks import judge_client

    reply = judge_client.ask(checker, args, kwargs)
    if "verdict" in reply:
        v = reply["verdict"]
        return Verdict(bool(v.get("ok")), str(v.get("exercise")), str(v.get("hint", "")), dict(v.get("evidence", {})))
    text = f"the checker could not finish: {reply.get('crash', 'no reply')}"
    print(f"✗ {text.splitlines()[-1] if text.splitlines() else text}")
    return Verdict(False, exercise_name, one_line(text)[-HINT_LIMIT:])


@dataclass(frozen=True)
class CheckerInfo:
    """A decorated checker as its source declares it: the exercise ``name`` template and its ``params``."""

    name: str
    params: tuple

    def exercise_of(self, call: ast.Call) -> str | None:
        """The exercise a call of this checker grades, its ``{fields}`` read from the call's literal
        arguments; None when a field is not a literal there."""
        if "{" not in self.name:
            return self.name
        values = dict(zip(self.params, call.args))
        values.update((k.arg, k.value) for k in call.keywords if k.arg)
        fields = {f for _, f, _, _ in string.Formatter().parse(self.name) if f}
        try:
            return self.name.format(**{f: ast.literal_eval(values[f]) for f in fields})
        except (KeyError, ValueError, TypeError, IndexError):
            return None


def checkers_in(folder: Path = Path(__file__).parent) -> dict[str, CheckerInfo]:
    """``{checker function name: CheckerInfo}`` of every ``@exercise(...)`` checker in ``folder``'s
    modules, read from their source (nothing is imported)."""
    found = {}
    for path in sorted(Path(folder).glob("*.py")):
        stat = path.stat()
        for name, info in _checkers_of(str(path), stat.st_mtime_ns, stat.st_size):
            if name in found:  # the grader finds a checker cell's exercise by the name it calls
                raise ValueError(f"two checkers are named {name} ({path.name} and another module of "
                                 f"{folder}): rename one")
            found[name] = info
    return found


@functools.lru_cache(maxsize=256)
def _checkers_of(path: str, mtime_ns: int, size: int) -> tuple:
    """``(name, CheckerInfo)`` of the checkers of one module's source, in order; cached per version of the file
    (parsing every checker module takes ~0.35 s, and a grading reads the units of every lab)."""
    found = []
    for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id == "exercise"
                    and deco.args and isinstance(deco.args[0], ast.Constant)):
                found.append((node.name, CheckerInfo(deco.args[0].value, tuple(a.arg for a in node.args.args))))
    return tuple(found)
