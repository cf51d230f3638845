"""Verdict helpers every checker uses: robust comparisons, guarded student calls, traffic checks.

A checker must give the right verdict to *any* answer a student can write, and
never raise. This module holds the pieces every lab's checker needs:

Numbers and values
    :func:`as_real` / :func:`same_number` accept a right number of any real type
    (int, float, ``Fraction``, ``Decimal``, a numpy scalar, a one-element tensor
    or array) within a relative tolerance, and reject NaN, infinities, bools,
    complex numbers, strings and ``None`` with a reason the student can act on.
    :func:`as_whole` / :func:`whole_numbers` read a whole number (or a list of
    them) of any real type. :func:`same_value` compares nested answers (tensors,
    arrays, lists, dicts) and never raises, even for objects whose ``==`` raises or
    returns an array; :func:`tensors_close` compares a tensor with a reference
    within a tolerance relative to the reference's scale.
    :func:`safe_repr` prints any answer in one short line.

Running the student's code
    :func:`run_student` calls the student's function, undoes any monkeypatch it
    made (functions and classes of ``torch``, ``torch.nn.functional``,
    ``torch.distributed`` and every loaded ``course_lib`` module, methods of
    their classes, of ``torch.Tensor`` and ``torch.nn.Module``) and reports what it
    changed (:class:`StudentRun`), so a patch can neither fool the checker nor
    leak into later cells. With ``references=`` (an exercise's entry of
    :mod:`course_lib.classroom.checks.references`) it also reports which of the
    course's own implementations ran inside the call (a profile hook on their
    code objects: aliases, ``getattr``, wrappers, partials do not hide them, nor does
    an ``exec`` of their source: a copy is known by its name, arguments and names used),
    and -- always -- any function of a checker module the student's code called (its
    truth tables, its input generators), except what the checker handed over.
    :func:`course_function` recognises a function that *is* (or wraps, or
    partially applies) one from ``course_lib``; :func:`course_code_hint` words
    the verdict. :func:`student_on_rank` is :func:`run_student` inside a rank of
    :func:`launch_checked`, with the rank's wire recorded and the value made
    :func:`portable` (it travels back to the checker); :func:`call_problem` words
    what its patches or course code were.

Communication (see :mod:`course_lib.classroom.checks.wire` for how it is seen)
    Checkers that must prove the algorithm run the student's code on ranks with
    :func:`launch_checked`: the default process group is replaced by one that
    records every op (:func:`wire_recorder`) and that refuses collectives inside
    :func:`point_to_point_only` -- at the process-group level, so no Python name
    (``distributed_c10d``, a name bound earlier, object collectives, gather +
    scatter) gets past. Over the recorded :class:`course_lib.comm.CommEvent`
    lists: :func:`elements_sent`, :func:`collectives`, :func:`describe_ops`,
    :func:`expect_collectives` (exact ops on given groups) and
    :func:`refused_collective` (find the refusal in a rank's traceback).
"""

from __future__ import annotations

import contextlib
import decimal
import fractions
import functools
import inspect
import math
import numbers
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from course_lib.classroom.checks.wire import (REFUSED_MARK, SPLIT_MARK, CollectiveRefused, SplitMismatch, drawn_rng,
                                             largest_tensor, launch_checked, point_to_point_only, secret_generator,
                                             student_running, wire_recorder)

__all__ = [
    "Comparison", "as_real", "as_whole", "whole_numbers", "same_number", "same_value", "tensors_close", "safe_repr",
    "StudentRun", "run_student", "student_on_rank", "call_problem", "portable", "undo_patches", "course_function",
    "course_code_hint", "LibraryPatched",
    "launch_checked", "point_to_point_only", "wire_recorder", "CollectiveRefused", "REFUSED_MARK",
    "SplitMismatch", "SPLIT_MARK", "secret_generator", "drawn_rng", "largest_tensor",
    "elements_sent", "collectives", "describe_ops", "expect_collectives", "refused_collective", "split_problem",
    "carried_by", "same_payload",
]


# ----------------------------------------------------------------------------------- numbers


@dataclass(frozen=True)
class Comparison:
    """One answer compared with the truth: ``ok`` and, when not ok, ``reason`` (one sentence for the
    student). Truthy when ok. (A checker's verdict on a whole exercise is an
    :class:`~course_lib.classroom.checks.exercise.Verdict`.)"""

    ok: bool
    reason: str | None = None
    value: float | None = None

    def __bool__(self) -> bool:
        return self.ok


def as_real(value) -> tuple[float | None, str | None]:
    """``(float, None)`` for a finite real number of any type, else ``(None, reason)``.

    Accepted: int, float, ``Fraction``, ``Decimal``, numpy scalars, and tensors or
    arrays with exactly one real element. Refused with a reason: bools, complex
    numbers, strings, ``None``, NaN, infinities, containers, anything else.
    """
    import numpy as np
    import torch

    if value is None:
        return None, "returned None: did the function end without `return`?"
    if isinstance(value, (bool, np.bool_)):
        return None, f"returned the bool {value!r}: return the number itself"
    if isinstance(value, (str, bytes)):
        return None, f"returned the string {safe_repr(value)}: return a number, not its text"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        try:
            numel = value.numel() if isinstance(value, torch.Tensor) else value.size
            dtype = value.dtype
        except Exception:  # noqa: BLE001 - an odd subclass
            return None, f"returned an unreadable {type(value).__name__}"
        if numel != 1:
            return None, (f"returned a {type(value).__name__} of shape {tuple(value.shape)}: return one number "
                          f"(a single value, e.g. `.item()`)")
        if dtype in (torch.bool, np.bool_) or str(dtype) == "bool":
            return None, "returned a bool tensor: return the number itself"
        if getattr(dtype, "is_complex", False) or str(dtype).startswith("complex"):
            return None, "returned a complex number: the answer is real"
        value = value.item()
        if isinstance(value, bool):
            return None, "returned a bool tensor: return the number itself"
    if isinstance(value, (complex, np.complexfloating)):
        return None, f"returned the complex number {value!r}: the answer is real"
    if not isinstance(value, (numbers.Real, decimal.Decimal, np.number)):
        return None, f"returned a {type(value).__name__} ({safe_repr(value)}): return a number"
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError, ArithmeticError):
        return None, f"returned {safe_repr(value)}, which is not a finite number"
    if math.isnan(number):
        return None, "returned NaN (not a number): look for 0/0 or an undefined case"
    if math.isinf(number):
        return None, f"returned {number} (infinite): look for a division by zero"
    return number, None


def as_whole(value) -> int | None:
    """The integer ``value`` stands for (int, numpy integer, integral float/Fraction, one-element tensor), or None."""
    number, _ = as_real(value)
    return int(number) if number is not None and number.is_integer() else None


def whole_numbers(value) -> list[int] | None:
    """``value`` as a list of ints (list, tuple, range, array or tensor of whole numbers of any real type), or None."""
    try:
        if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
            value = value.tolist()
        if isinstance(value, (str, bytes, dict, bool)):
            return None
        items = [as_whole(v) for v in value]
    except Exception:  # noqa: BLE001 - not iterable, or a raising element
        return None
    return None if any(v is None for v in items) else items


def same_number(answer, expected, rel: float = 1e-9, abs_tol: float = 1e-12) -> Comparison:
    """Is ``answer`` a finite real number within ``rel`` (relative) or ``abs_tol`` of ``expected``?

    ``Comparison.value`` is the answer as a float whenever it is a number (use it to
    match the answer against known wrong formulas for a hint)."""
    number, reason = as_real(answer)
    if reason:
        return Comparison(False, reason)
    want = float(expected)
    if math.isclose(number, want, rel_tol=rel, abs_tol=abs_tol):
        return Comparison(True, None, number)
    return Comparison(False, f"returned {number:.6g}, expected {want:.6g}", number)


def safe_repr(value, limit: int = 80) -> str:
    """``repr(value)`` on one line, at most ``limit`` characters; never raises."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a student's __repr__ may raise
        text = f"<{type(value).__name__} object>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def same_value(answer, expected, rel: float = 0.0) -> bool:
    """Does ``answer`` equal ``expected``? Never raises.

    Numbers compare as numbers of any real type (:func:`same_number`, tolerance
    ``rel``); tensors and arrays by shape and values (any real dtype); lists and
    tuples element by element (a tuple answers a list; a tensor or array answers a
    list of numbers); dicts by keys and values; bools only equal bools; anything
    else with ``==``, which must return a real bool.
    """
    try:
        return _same(answer, expected, rel)
    except Exception:  # noqa: BLE001 - an odd answer is a wrong answer, never a crash
        return False


def tensors_close(a, b, tol: float = 1e-5) -> bool:
    """``a`` is a real tensor of ``b``'s shape, finite, within ``tol`` of ``b`` relative to ``b``'s scale
    (``max |a - b| <= tol · max(1, max |b|)``); never raises."""
    import torch

    try:
        if not isinstance(a, torch.Tensor) or tuple(a.shape) != tuple(b.shape) or a.is_complex():
            return False
        diff = (a.detach().double() - b.detach().double()).abs()
        return bool(torch.isfinite(diff).all()) and diff.max().item() <= tol * max(1.0, b.abs().max().item())
    except Exception:  # noqa: BLE001 - an odd answer is a wrong answer
        return False


def _same(answer, expected, rel: float) -> bool:
    import numpy as np
    import torch

    if isinstance(expected, (bool, np.bool_)):
        return isinstance(answer, (bool, np.bool_)) and bool(answer) == bool(expected)
    if isinstance(expected, (numbers.Real, decimal.Decimal)):
        return bool(same_number(answer, expected, rel=rel, abs_tol=0.0 if rel == 0 else 1e-12))
    if isinstance(expected, (torch.Tensor, np.ndarray)):
        if not isinstance(answer, (torch.Tensor, np.ndarray)):
            return False
        a, e = torch.as_tensor(answer), torch.as_tensor(expected)
        if tuple(a.shape) != tuple(e.shape) or a.dtype == torch.bool or a.is_complex():
            return False
        a, e = a.detach().double(), e.detach().double()
        return bool(torch.equal(a, e) if rel == 0 else torch.allclose(a, e, rtol=rel, atol=0.0))
    if isinstance(expected, str):
        return isinstance(answer, str) and answer == expected
    if isinstance(expected, dict):
        if not isinstance(answer, dict) or set(answer) != set(expected):
            return False
        return all(_same(answer[k], v, rel) for k, v in expected.items())
    if isinstance(expected, (list, tuple)):
        if isinstance(answer, (torch.Tensor, np.ndarray)):
            answer = answer.tolist()
        if not isinstance(answer, (list, tuple)) or len(answer) != len(expected):
            return False
        return all(_same(a, e, rel) for a, e in zip(answer, expected))
    result = answer == expected
    return isinstance(result, (bool, np.bool_)) and bool(result)


# ------------------------------------------------------------------------ student code


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
    for name, module in list(sys.modules.items()):
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
                if now.get(key, _MISSING) is not old and _is_code(old):
                    changed.append(f"{name}.{key}")
                    setattr(owner, key, old)
            if isinstance(owner, type):
                for key in [k for k in now if k not in before and _is_code(now[k])]:
                    changed.append(f"{name}.{key}")
                    delattr(owner, key)


_MISSING = object()


def _code_objects(fn) -> dict:
    """``{code object: name}`` of a reference implementation (a function; for a class, every method,
    each named after the class)."""
    fn = _unwrap(fn)
    if isinstance(fn, type):
        found = {}
        for attr in vars(fn).values():
            attr = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            attr = attr.fget if isinstance(attr, property) else attr
            code = getattr(_unwrap(attr), "__code__", None) if callable(attr) else None
            if code is not None:
                found[code] = _qualified(fn)
        return found
    code = getattr(fn, "__code__", None)
    return {code: _qualified(fn)} if code is not None else {}


_CHECKS_DIR = os.path.dirname(os.path.abspath(__file__))
_MACHINERY = {"wire.py", "verdicts.py", "__init__.py", "exercise.py", "judge.py", "judge_client.py",
              "workers.py", "plain.py", "student_code.py", "refusals.py"}
"""Files of the checks package whose code may run inside a student's call: the checked process group
(every collective passes through it), the verdict helpers and the verdict record (what the student's code
prints passes through it)."""


def _is_checker_code(code) -> bool:
    """Code of a checker module (its truth functions, its input generators): never part of an answer."""
    path = code.co_filename
    return os.path.dirname(path) == _CHECKS_DIR and os.path.basename(path) not in _MACHINERY


def _signature(code) -> tuple:
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
    code object or by a copy of it (:func:`_signature`)."""
    watched = {}
    for ref in references:
        watched.update(_code_objects(ref))
    # Copies are recognised only for code that says something: a one-line ``return grad, None`` written
    # by a student is the same code as the course's, and no copy.
    copies = {_signature(code): name for code, name in watched.items() if len(set(code.co_names)) >= 4}
    names = {code.co_name for code in watched}
    verdicts: dict = {}
    seen: list[str] = []

    def verdict(frame) -> str:
        code = frame.f_code
        if code in watched:
            return watched[code]
        if code.co_name in names and _signature(code) in copies:
            return copies[_signature(code)]
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
    return f"a {type(value).__name__} ({safe_repr(value, 50)})"


def student_on_rank(fn, *args, references: Sequence = (), measure: bool = False, raw: bool = False) -> dict:
    """Inside a rank of :func:`launch_checked`: run ``fn(*args)`` with every op on the wire recorded.

    Re-raises the student's exception (so the launcher stops the other ranks at once); otherwise
    returns ``value`` (:func:`portable` of what came back), ``events`` (the rank's
    :class:`~course_lib.comm.CommEvent` list), ``carried`` (what each event sent, see
    :class:`~course_lib.classroom.checks.wire.WireRecorder`), ``patched`` (library names it replaced,
    undone) and ``course_code`` (the ``references`` that ran inside it); with ``measure``, also
    ``largest`` and ``largest_op``: the largest tensor the call computed (:func:`largest_tensor`); with
    ``raw``, also ``raw``: the returned object itself, for checks on the rank (pop it before returning
    the dict from the rank: it may not pickle)."""
    with wire_recorder() as rec, (largest_tensor() if measure else contextlib.nullcontext()) as seen:
        run = run_student(fn, *args, references=references)
    if run.error is not None:
        raise run.error
    out = dict(value=portable(run.value), events=list(rec.events), carried=list(rec.carried), patched=run.patched,
               course_code=run.course_code)
    if measure:
        out.update(largest=seen.largest, largest_op=seen.op)
    if raw:
        out["raw"] = run.value
    return out


def call_problem(result: dict) -> str | None:
    """The line for a :func:`student_on_rank` ``result`` whose call patched the library or ran the course's
    own code (as :meth:`StudentRun.problem` words it), else None."""
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
    if not name.startswith("course_lib"):
        return (f"your function used {name}, which computes this exercise's answer: the exercise is to write it "
                f"yourself (the judge refuses it where your function runs)")
    return (f"your function runs the course's own {name}: the exercise is to write it yourself "
            f"(reading it is fine; calling it proves nothing)")


# ---------------------------------------------------------------------------- traffic

_POINT_TO_POINT = ("send", "recv")


def elements_sent(events, op: str = "send") -> int:
    """Elements in the ``op`` events (default: every point-to-point send) of one rank."""
    return sum(e.numel for e in events if e.op == op)


def collectives(events) -> list:
    """The events that are not point-to-point (each one a collective the rank joined)."""
    return [e for e in events if e.op not in _POINT_TO_POINT]


def describe_ops(events) -> str:
    """``"2 all_reduce on world (8 + 4 elements), 1 all_gather on ranks 0,1 (8 elements)"``, or ``"nothing"``."""
    sizes: dict = {}
    for e in events:
        sizes.setdefault((e.op, e.kind), []).append(e.numel)
    if not sizes:
        return "nothing"

    def elements(numels):
        if len(numels) == 1:
            return f"{numels[0]} elements"
        if len(numels) <= 8:
            return " + ".join(map(str, numels)) + " elements"
        return f"{sum(numels)} elements in all"

    return ", ".join(f"{len(n)} {op} on {kind} ({elements(n)})" for (op, kind), n in sizes.items())


def expect_collectives(events, expected: dict, *, what: str = "the exercise") -> str | None:
    """None when the collectives among ``events`` are exactly ``expected`` (``{(op, kind): count}``,
    e.g. ``{("all_reduce", "world"): 1}``); else one line naming what ran instead."""
    got = Counter((e.op, e.kind) for e in collectives(events))
    want = Counter({key: n for key, n in expected.items() if n})
    if got == want:
        return None
    wanted = ", ".join(f"{n} {op} on {kind}" for (op, kind), n in want.items()) or "no collective"
    return f"{what} needs exactly {wanted}; it ran {describe_ops(collectives(events))}"


def _marked_line(traceback_text: str, mark: str) -> str | None:
    for line in reversed((traceback_text or "").splitlines()):
        if mark in line:
            return line.split(mark, 1)[1].strip()
    return None


def refused_collective(traceback_text: str) -> str | None:
    """The refusal line in a rank's traceback (a collective in a point-to-point exercise), or None."""
    return _marked_line(traceback_text, REFUSED_MARK)


def split_problem(traceback_text: str) -> str | None:
    """The :class:`SplitMismatch` line in a rank's traceback (all-to-all sizes that cannot work), or None."""
    return _marked_line(traceback_text, SPLIT_MARK)


def carried_by(result: dict, op: str) -> list:
    """What this rank sent in each ``op`` event of a :func:`student_on_rank` ``result`` (same order)."""
    return [c for e, c in zip(result["events"], result["carried"]) if e.op == op]


def same_payload(carried, want, tol: float = 1e-9) -> bool:
    """Did an op carry ``want`` (a tensor; its elements in order, any shape or real dtype)? Never raises."""
    import torch

    if isinstance(carried, list):
        carried = torch.cat([t.reshape(-1) for t in carried]) if carried else None
    if not isinstance(carried, torch.Tensor) or carried.numel() != want.numel():
        return False
    return tensors_close(carried.reshape(-1), want.reshape(-1), tol=tol)
