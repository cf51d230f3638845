"""The tamper guard around a call of the student's code: patches undone, the course's answers and the checkers'
internals seen when they run inside the call.

:func:`run_student` calls the student's function, undoes any monkeypatch it made (functions and classes of
``torch``, ``torch.nn.functional``, ``torch.distributed`` and every loaded ``course_lib`` module, methods of their
classes, of ``torch.Tensor`` and ``torch.nn.Module``: :func:`undo_patches`) and reports what it changed
(:class:`StudentRun`), so a patch can neither fool the checker nor leak into later cells. With ``references=``
(an exercise's entry of :mod:`course_lib.classroom.checks.references`) it also reports which of the course's own
implementations ran inside the call (a ``sys.setprofile`` hook on their code objects: aliases, ``getattr``,
wrappers, partials do not hide them, nor does an ``exec`` of their source: a copy is known by its name, arguments
and names used), and -- always -- any function of a checker module the student's code called (its truth tables,
its input generators), except what the checker handed over. :func:`course_function` recognises a function that
*is* (or wraps, or partially applies) one from ``course_lib``; :func:`course_code_hint` words the verdict.
:func:`on_rank_result` is what a rank check reads of a call (the rank's wire recorded, the value made
:func:`portable`); :func:`call_problem` words what its patches or course code were.

Where it matters: the judge runs the student's function in worker processes
(:mod:`~course_lib.classroom.checks.workers`, where :mod:`~course_lib.classroom.checks.refusals` refuses the
answer's modules), so in the judge's check process this guard only reports what the worker saw; on the ranks of a
launch it runs in the student process (:mod:`~course_lib.classroom.checks.student_process`), never beside the
checker's rank code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from course_lib.classroom.checks import plain
from course_lib.classroom.checks.verdicts import safe_repr
from course_lib.classroom.checks.wire import student_running

__all__ = ["LibraryPatched", "StudentRun", "run_student", "portable", "on_rank_result", "call_problem",
           "undo_patches", "course_function", "course_code_hint"]


class LibraryPatched(RuntimeError):
    """The student's function replaced a library function (the change was undone)."""


@dataclass
class StudentRun:
    """What one call of the student's function did: ``value`` or ``error`` (the exception),
    ``patched`` (library names it replaced; undone) and ``course_code`` (the names of the
    ``references`` that ran inside the call)."""

    value: Any = None
    error: BaseException | None = None
    patched: list[str] = field(default_factory=list)
    course_code: list[str] = field(default_factory=list)
    largest: tuple | None = None  # (elements, op) of the largest tensor, where a student process measured it
    peak: int | None = None  # bytes the student process's resident memory grew by at most, read by its rank
    written: int | None = None  # of those, the bytes it held before the call and wrote (see student_process)

    @property
    def todo(self) -> bool:
        """The exercise's stub still raises ``NotImplementedError``."""
        return isinstance(self.error, NotImplementedError)

    def problem(self) -> str | None:
        """One line saying what is wrong with the *call* (not the value): a patch, the course's own code
        (even when it then raised: that is what to change), an exception; None when the call was clean."""
        if self.patched:
            return (f"it replaced {', '.join(self.patched[:3])} (undone by the checker): an exercise's "
                    f"function must compute its answer, not change the library")
        if self.course_code:
            return course_code_hint(self.course_code[0])
        if self.error is not None:
            return f"raised {type(self.error).__name__}: {self.error}"
        return None


_OWNERS_CACHE: dict = {}
_TAKEN_OUT: dict = {}
"""Modules the judge's refusals took out of ``sys.modules`` for good in this process (the checkers, see
:func:`keep_guarding`): a patch of them is still undone and reported."""


def keep_guarding(modules: dict) -> None:
    """Go on guarding ``modules`` (``{name: module}``) once they are no longer in ``sys.modules``."""
    _TAKEN_OUT.update(modules)
    _OWNERS_CACHE.clear()


def _guarded_owners():
    """The modules and classes whose functions a checker relies on: (name, object) pairs.

    Cached while ``sys.modules`` keeps its size: scanning its thousands of entries (torch,
    megatron-core) on every student call made a checker that calls the student's function a
    hundred times take seconds."""
    key = len(sys.modules)
    if _OWNERS_CACHE.get("key") != key:
        _OWNERS_CACHE.update(key=key, owners=_scan_owners())
    return _OWNERS_CACHE["owners"]


def _scan_owners():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    owners = [("torch", torch), ("torch.nn.functional", F), ("torch.nn", torch.nn),
              ("torch.Tensor", torch.Tensor), ("torch.nn.Module", torch.nn.Module)]
    if dist.is_available():
        from torch.distributed import distributed_c10d

        owners += [("torch.distributed", dist), ("torch.distributed.distributed_c10d", distributed_c10d)]
    for name, module in list({**_TAKEN_OUT, **sys.modules}.items()):
        if module is None or not (name == "course_lib" or name.startswith("course_lib.")):
            continue
        owners.append((name, module))
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                owners.append((f"{name}.{attr}", value))
    return owners


def _is_code(value) -> bool:
    """A function, class or descriptor: what a monkeypatch replaces (state such as caches is left alone)."""
    return callable(value) or isinstance(value, (staticmethod, classmethod, property))


@contextlib.contextmanager
def undo_patches():
    """Undo, on exit, every replaced or deleted function/class of the guarded modules and classes
    (see :func:`run_student`); yields a list that receives the names that were changed."""
    snapshot = [(name, owner, dict(vars(owner))) for name, owner in _guarded_owners()]
    changed: list[str] = []
    try:
        yield changed
    finally:
        for name, owner, before in snapshot:
            now = vars(owner)
            try:
                if now == before:  # identity short-cut: no __eq__ of a value runs unless one changed
                    continue
            except Exception:  # noqa: BLE001 - a changed value's __eq__ raised: walk it below
                pass
            for key, old in before.items():
                if now.get(key, _MISSING) is not old and _is_code(old) and not _compilation_disabled(old, now.get(key)):
                    changed.append(f"{name}.{key}")
                    setattr(owner, key, old)
            if isinstance(owner, type):
                for key in [k for k in now if k not in before and _is_code(now[k])]:
                    changed.append(f"{name}.{key}")
                    delattr(owner, key)


_MISSING = object()


def _compilation_disabled(old, new) -> bool:
    """Whether ``new`` is ``torch._disable_dynamo(old)``: the same function with compilation off, which torch puts in
    its place itself -- importing ``torch._dynamo`` rewraps ``torch.manual_seed`` so (torch/_dynamo/__init__.py), and a
    student's code may import it without knowing (a ``torch.optim`` step, megatron-core). A wrapper of the student's
    own has other code, or does not hold ``old``."""
    torch = sys.modules.get("torch")
    disable = getattr(torch, "_disable_dynamo", None)
    if disable is None or getattr(new, "__wrapped__", None) is not old:
        return False
    return getattr(new, "__code__", None) is disable(old).__code__ and any(  # torch's code: its cells are filled
        c.cell_contents is old for c in new.__closure__ or ())


ORIGINAL_SIGNATURE = "__course_original_signature__"
"""The attribute where a function whose code the judge disarmed (:func:`course_lib.classroom.checks.refusals.apply`)
keeps its original code's :func:`code_signature` (plain data, nothing to run): a copy of that code is still named."""


def _code_objects(fn) -> list:
    """``[(code object, name, signature)]`` of a reference implementation (a function; for a class, every method,
    each named after the class); the signature is the original code's (:func:`code_signature`) where the judge
    disarmed it."""
    fn = _unwrap(fn)
    functions = [fn]
    if isinstance(fn, type):
        functions = []
        for attr in vars(fn).values():
            attr = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            attr = attr.fget if isinstance(attr, property) else attr
            if callable(attr):
                functions.append(_unwrap(attr))
    return [(f.__code__, _qualified(fn), getattr(f, ORIGINAL_SIGNATURE, None) or code_signature(f.__code__))
            for f in functions if getattr(f, "__code__", None) is not None]


_CHECKS_DIR = os.path.dirname(os.path.abspath(__file__))
_MACHINERY = {"wire.py", "verdicts.py", "tamper_guard.py", "__init__.py", "exercise.py", "judge.py",
              "judge_client.py", "workers.py", "plain.py", "student_code.py", "refusals.py", "student_process.py"}
"""Files of the checks package whose code may run inside a student's call: the checked process group
(every collective passes through it), the verdict helpers and the verdict record (what the student's code
prints passes through it)."""


def _is_checker_code(code) -> bool:
    """Code of a checker module (its truth functions, its input generators): never part of an answer."""
    path = code.co_filename
    return os.path.dirname(path) == _CHECKS_DIR and os.path.basename(path) not in _MACHINERY


def code_signature(code) -> tuple:
    """What a copy of a function keeps (``exec`` of its source, a reloaded module): its name, arguments,
    local variables and the global and attribute names it uses (the bytecode itself can differ: an ``exec``
    without the module's ``from __future__ import annotations`` compiles other instructions)."""
    return code.co_name, code.co_argcount, code.co_varnames, code.co_names


def _nested_codes(code, into: set) -> None:
    into.add(code)
    for const in code.co_consts:
        if isinstance(const, type(code)):
            _nested_codes(const, into)


def _handed_over(args) -> set:
    """Code objects the checker hands the student (``make_optimizer``, a callback) and everything nested in
    them: these run inside the student's call by design."""
    found: set = set()
    items = list(args)
    for arg in list(items):
        if isinstance(arg, (list, tuple)):
            items.extend(arg)
        elif isinstance(arg, dict):
            items.extend(arg.values())
    for item in items:
        code = getattr(_unwrap(item), "__code__", None) if callable(item) else None
        if code is not None:
            _nested_codes(code, found)
    return found


@contextlib.contextmanager
def _watch_code(references, handed_over=frozenset()) -> Iterable[list]:
    """Yields a list that receives the name of each reference whose code runs inside the block, and of each
    checker function (:func:`_is_checker_code`) not in ``handed_over``. A reference is recognised by its
    code object or by a copy of it (:func:`code_signature`)."""
    found = [triple for ref in references for triple in _code_objects(ref)]
    watched = {code: name for code, name, _ in found}
    # Copies are recognised only for code that says something: a one-line ``return grad, None`` written
    # by a student is the same code as the course's, and no copy.
    copies = {signature: name for _, name, signature in found if len(set(signature[3])) >= 4}
    names = {signature[0] for signature in copies}
    verdicts: dict = {}
    seen: list[str] = []

    def verdict(frame) -> str:
        code = frame.f_code
        if code in watched:
            return watched[code]
        if code.co_name in names and code_signature(code) in copies:
            return copies[code_signature(code)]
        if code not in handed_over and _is_checker_code(code):
            return f"{frame.f_globals.get('__name__', '?')}.{code.co_qualname}"
        return ""

    def profile(frame, event, _arg):
        if event != "call":
            return
        code = frame.f_code
        name = verdicts.get(code)
        if name is None:
            name = verdicts[code] = verdict(frame)
        if name and name not in seen:
            seen.append(name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def run_student(fn, *args, references: Sequence = (), **kwargs) -> StudentRun:
    """Call ``fn(*args, **kwargs)``; never raises (except ``KeyboardInterrupt``).

    Monkeypatches are undone and listed in ``patched``; ``references`` (course
    functions or classes the exercise asks the student to write themselves, see
    :func:`course_lib.classroom.checks.references.references_for`) that ran inside the call are
    listed in ``course_code`` -- and so is any function of a checker module the student's code
    called (a truth table, an input generator), except the callables handed over in ``args``."""
    run = StudentRun()
    with undo_patches() as changed:
        with _watch_code(references, _handed_over(args + tuple(kwargs.values()))) as seen, student_running():
            try:
                run.value = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to the student
                run.error = exc
    run.patched, run.course_code = list(changed), list(seen)
    run.patched += [n for n in getattr(fn, "patched", ()) if n not in run.patched]  # in the judge's worker
    for name in getattr(fn, "refused", ()):  # what the judge's worker refused (a StudentFunction)
        if name not in run.course_code:
            run.course_code.append(name)
    return run


def portable(value):
    """What travels back from a rank: a tensor as it is (detached, cloned); anything else as a
    short description that pickles (``"a list ([1, 2])"``)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return f"a {plain.type_name(value)} ({safe_repr(value, 50)})"


def on_rank_result(run: StudentRun, rec, measure: bool, raw: bool) -> dict:
    """The dict of :func:`course_lib.classroom.checks.student_process.student_on_rank` for a call ``run`` whose
    ops ``rec`` recorded (raises its error): ``value`` (:func:`portable` of what came back), ``events`` (the
    rank's :class:`~course_lib.comm.CommEvent` list), ``carried`` (what each event sent, see
    :class:`~course_lib.classroom.checks.wire.WireRecorder`), ``patched`` (library names it replaced, undone)
    and ``course_code`` (the ``references`` that ran inside it); with ``measure``, also ``largest`` and
    ``largest_op`` (the largest tensor the call computed, measured in the student process) and ``peak`` (the bytes
    its resident memory grew by during the call, read by the rank from ``/proc``, and ``written``: the bytes of it
    it held before the call and wrote; None unless the rank asked for them); with ``raw``, also ``raw``: the
    returned value."""
    if run.error is not None:
        raise run.error
    out = dict(value=portable(run.value), events=list(rec.events), carried=list(rec.carried), patched=run.patched,
               course_code=run.course_code)
    if measure:
        largest, op = run.largest or (0, None)
        out.update(largest=largest, largest_op=op, peak=run.peak, written=run.written)
    if raw:
        out["raw"] = run.value
    return out


def call_problem(result: dict) -> str | None:
    """The line for a ``student_process.student_on_rank`` (or a rank check's) ``result`` whose
    call patched the library or ran the course's own code (as :meth:`StudentRun.problem` words it), else None."""
    return StudentRun(patched=result["patched"], course_code=result["course_code"]).problem()


def _unwrap(fn):
    for _ in range(20):  # partials of wrappers of bound methods...
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif getattr(fn, "__wrapped__", None) is not None:
            fn = fn.__wrapped__
        else:
            return fn
    return fn


def _qualified(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


def course_function(fn) -> str | None:
    """The qualified name when ``fn`` is (or wraps, or partially applies) a function or class of
    ``course_lib`` itself, else None."""
    target = _unwrap(fn)
    module = getattr(target, "__module__", None) or ""
    if module == "course_lib" or module.startswith("course_lib."):
        return _qualified(target)
    return None


def course_code_hint(name: str) -> str:
    """The verdict line for an answer that is (or calls) the course's own implementation ``name`` (or, refused
    by the judge, a library that computes the answer)."""
    if name.startswith("reading "):  # a file the judge's rule refused (refusals.Refusals.note_denied)
        return (f"your function tried {name} (Permission denied where your function runs): it computes this "
                f"exercise's answer, or is the checker's own, and the exercise is to write it yourself")
    if not name.startswith("course_lib"):
        return (f"your function used {name}, which computes this exercise's answer: the exercise is to write it "
                f"yourself (the judge refuses it where your function runs)")
    if name == "course_lib.classroom" or name.startswith("course_lib.classroom."):
        return (f"your function reached into the checker ({name}): its code and its data are the verdict's, not "
                f"yours, and the judge refuses them where your function runs")
    return (f"your function runs the course's own {name}: the exercise is to write it yourself "
            f"(reading it is fine; calling it proves nothing)")
