"""Verdict helpers every checker uses: robust comparisons and traffic checks.

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
    lives in :mod:`course_lib.classroom.checks.tamper_guard` (:func:`run_student` and the rest: patches
    undone, the course's own answers and the checkers' internals seen when they run inside a call).

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

import decimal
import fractions
import math
import numbers
from collections import Counter
from dataclasses import dataclass

from course_lib.classroom.checks.wire import (REFUSED_MARK, SPLIT_MARK, CollectiveRefused, SplitMismatch, drawn_rng,
                                             largest_tensor, launch_checked, point_to_point_only, secret_generator,
                                             wire_recorder)

__all__ = [
    "Comparison", "as_real", "as_whole", "whole_numbers", "same_number", "same_value", "tensors_close", "safe_repr",
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


def all_reduce_in_two_steps(events) -> bool:
    """A reduce-scatter (sum) then an all-gather: an all-reduce written as its two halves, the same wire."""
    return [e.op for e in events] == ["reduce_scatter", "all_gather"] and events[0].reduce_op in (None, "sum")


def carried_by(result: dict, op: str) -> list:
    """What this rank sent in each ``op`` event of a :func:`student_on_rank` ``result`` (same order)."""
    return [c for e, c in zip(result["events"], result["carried"]) if e.op == op]


def same_payload(carried, want, tol: float = 1e-9, any_order: bool = False) -> bool:
    """Did an op carry ``want`` (a tensor; its elements in order, any shape or real dtype; with ``any_order``, in any
    order: a reduce-scatter's input may be cut along any dimension)? Never raises."""
    import torch

    if isinstance(carried, list):
        carried = torch.cat([t.reshape(-1) for t in carried]) if carried else None
    if not isinstance(carried, torch.Tensor) or carried.numel() != want.numel():
        return False
    got, expected = carried.reshape(-1), want.reshape(-1)
    if any_order:
        got, expected = got.double().sort().values, expected.double().sort().values
    return tensors_close(got, expected, tol=tol)
