"""Plain data across the judge's process boundaries: JSON with a few tagged types, never pickle.

What a student's function returns, and what a checker cell hands the judge, travels as JSON text
(:func:`dumps` / :func:`loads`). Decoding builds only values -- numbers, strings, lists, tuples, dicts,
sets, ranges, tensors and numpy arrays from their raw bytes, ``Fraction``, ``Decimal`` -- and dataclasses of
``course_lib`` itself (their own constructors run, nothing else). Anything else arrives as an
:class:`Opaque` stand-in that keeps the type's name, its ``repr`` and its attributes (themselves
plain), so a checker's "returned a Foo" still reads right and nothing of the sender runs in the
receiver (the rule :mod:`pickle` cannot keep: unpickling calls what the bytes name).

A tensor keeps dtype, shape, values and ``requires_grad``; its ``grad`` and its autograd history do not
travel (tensors are sent by value).

An exception travels as :func:`error_data` and is raised again from :func:`error_from_data`: its type (the
builtin one only when it was the builtin, the checker's own classes the receiver names), its message and, chained,
where it was raised.
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import decimal
import fractions
import importlib
import json
import traceback

DEPTH_LIMIT = 32
"""Nesting levels encoded; deeper values arrive as :class:`Opaque`."""


class Opaque:
    """Stand-in for a value that does not travel as data: its type's name, ``repr`` and plain attributes."""

    def __init__(self, type_name: str, text: str, attrs: dict | None = None):
        self.__dict__.update(attrs or {})
        self._type_name, self._text = type_name, text

    def __repr__(self) -> str:
        return self._text


def type_name(value) -> str:
    """The name of ``value``'s type, or of the type an :class:`Opaque` stand-in (or a namedtuple that
    travelled) stands for."""
    if isinstance(value, (Opaque, _OpaqueTuple)):
        return value._type_name
    return type(value).__name__


def _class_path(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve(path: str):
    """The object ``"module:qualname"`` names, imported here (through this process's import rules)."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _course_class(path: str):
    """The class ``"module:qualname"`` names, when it is a dataclass of course_lib (else None)."""
    if not (path.startswith("course_lib:") or path.startswith("course_lib.")):
        return None
    try:
        obj = resolve(path)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) and dataclasses.is_dataclass(obj) else None


def _raw(array_bytes: bytes) -> str:
    return base64.b64encode(array_bytes).decode("ascii")


def encode(value, depth: int = 0):
    """``value`` as JSON-able data (see the module docstring)."""
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > DEPTH_LIMIT:
        return {"$": "opaque", "type": type(value).__name__, "repr": "(nested too deep)", "attrs": {}}
    nested = depth + 1
    if isinstance(value, list):
        return [encode(v, nested) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"$": "tuple", "v": [encode(v, nested) for v in value]}
    if isinstance(value, dict):
        return {"$": "dict", "v": [[encode(k, nested), encode(v, nested)] for k, v in value.items()]}
    if isinstance(value, (set, frozenset)):
        return {"$": type(value).__name__, "v": [encode(v, nested) for v in value]}
    if isinstance(value, range):
        return {"$": "range", "v": [value.start, value.stop, value.step]}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {"$": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "grad": bool(value.requires_grad), "data": _raw(t.reshape(-1).view(torch.uint8).numpy().tobytes())}
    if isinstance(value, np.ndarray) and value.dtype != object:
        a = np.ascontiguousarray(value)
        return {"$": "ndarray", "dtype": a.dtype.str, "shape": list(a.shape), "data": _raw(a.tobytes())}
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        return {"$": "npscalar", "dtype": value.dtype.str, "data": _raw(value.tobytes())}
    if isinstance(value, fractions.Fraction):
        return {"$": "fraction", "v": [value.numerator, value.denominator]}
    if isinstance(value, decimal.Decimal):
        return {"$": "decimal", "v": str(value)}
    if isinstance(value, complex):
        return {"$": "complex", "v": [value.real, value.imag]}
    if isinstance(value, bytes):
        return {"$": "bytes", "v": _raw(value)}
    if isinstance(value, torch.dtype):
        return {"$": "dtype", "v": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and _course_class(_class_path(type(value))):
        return {"$": "dataclass", "cls": _class_path(type(value)),
                "v": {f.name: encode(getattr(value, f.name), nested) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):  # a namedtuple: its fields travel as attributes, its items as a tuple
        return {"$": "opaque", "type": type(value).__name__, "repr": _repr(value),
                "attrs": {k: encode(getattr(value, k), nested) for k in value._fields},
                "items": [encode(v, nested) for v in value]}
    attrs = {}
    if not callable(value) and isinstance(getattr(value, "__dict__", None), dict):
        attrs = {k: encode(v, nested) for k, v in list(vars(value).items())[:64] if isinstance(k, str)}
    return {"$": "opaque", "type": type(value).__name__, "repr": _repr(value), "attrs": attrs}


def _repr(value) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a student's __repr__ may raise
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 200 else text[:197] + "..."


def decode(data):
    """The value :func:`encode` described (see the module docstring for what is built)."""
    import numpy as np
    import torch

    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    tag, v = data.get("$"), data.get("v")
    if tag == "tuple":
        return tuple(decode(x) for x in v)
    if tag == "dict":
        return {_key(decode(k)): decode(x) for k, x in v}
    if tag in ("set", "frozenset"):
        items = [_key(decode(x)) for x in v]
        return set(items) if tag == "set" else frozenset(items)
    if tag == "tensor":
        dtype = getattr(torch, data["dtype"])
        raw = bytearray(base64.b64decode(data["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        t = flat.view(dtype).reshape(data["shape"]).clone()
        return t.requires_grad_(True) if data["grad"] and (t.is_floating_point() or t.is_complex()) else t
    if tag == "ndarray":
        return np.frombuffer(base64.b64decode(data["data"]), dtype=np.dtype(data["dtype"])).reshape(data["shape"]).copy()
    if tag == "npscalar":
        return np.frombuffer(base64.b64decode(data["data"]), dtype=np.dtype(data["dtype"]))[0]
    if tag == "range":
        return range(*(int(x) for x in v))
    if tag == "fraction":
        return fractions.Fraction(*v)
    if tag == "decimal":
        return decimal.Decimal(v)
    if tag == "complex":
        return complex(*v)
    if tag == "bytes":
        return base64.b64decode(v)
    if tag == "dtype":
        return getattr(torch, v)
    if tag == "dataclass":
        cls = _course_class(data["cls"])
        fields = {k: decode(x) for k, x in v.items()}
        if cls is not None:
            init = {f.name for f in dataclasses.fields(cls) if f.init}
            try:
                obj = cls(**{k: x for k, x in fields.items() if k in init})
                for k, x in fields.items():
                    if k not in init:
                        object.__setattr__(obj, k, x)
                return obj
            except Exception:  # noqa: BLE001 - a value its constructor refuses: arrives as a stand-in
                pass
        return Opaque(data["cls"].rpartition(".")[2], data["cls"], fields)
    if tag == "opaque":
        attrs = {k: decode(x) for k, x in data.get("attrs", {}).items()}
        if "items" in data:
            return _OpaqueTuple(data["type"], data["repr"], attrs, [decode(x) for x in data["items"]])
        return Opaque(data["type"], data["repr"], attrs)
    raise ValueError(f"plain data: unknown tag {tag!r}")


class _OpaqueTuple(tuple):
    """A namedtuple that travelled: a tuple of its items, with its fields as attributes."""

    def __new__(cls, type_name, text, attrs, items):
        obj = super().__new__(cls, items)
        obj.__dict__.update(attrs)
        obj._type_name, obj._text = type_name, text
        return obj

    def __repr__(self) -> str:
        return self._text


def _key(value):
    return value if not isinstance(value, list) else tuple(value)


def dumps(value) -> str:
    """``value`` as one line of JSON (:func:`encode`)."""
    return json.dumps(encode(value), separators=(",", ":"))


def loads(text: str):
    """The value of a :func:`dumps` line."""
    return decode(json.loads(text))


class StudentTraceback(Exception):
    """Where the student's code raised, in the process it ran in (chained under the exception raised again)."""


def error_data(exc: BaseException, with_traceback: bool = True) -> dict:
    """``exc`` as plain data: its type's name, whether that type is the builtin of that name, its message and
    (with ``with_traceback``) where it was raised (:func:`error_from_data` raises it again)."""
    name = type(exc).__name__
    return {"type": name, "builtin": getattr(builtins, name, None) is type(exc), "message": str(exc)[:4000],
            "traceback": "".join(traceback.format_exception(exc))[-4000:] if with_traceback else ""}


def error_from_data(error: dict, known: tuple = ()) -> BaseException:
    """The exception :func:`error_data` described: of the class of its name in ``known`` (a checker's own: the
    wire's refusals, the judge's), else the builtin when it was one, else a ``RuntimeError`` subclass of that
    name; with its message and, chained as its cause, the traceback it came with."""
    name, message = str(error.get("type", "RuntimeError"))[:100], str(error.get("message", ""))
    cls = next((k for k in known if k.__name__ == name), None)
    if cls is None and error.get("builtin"):
        cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = _named_error(name)
    try:
        exc = cls(message)
    except Exception:  # noqa: BLE001 - a builtin that wants other arguments
        exc = _named_error(name)(message)
    if error.get("traceback"):
        exc.__cause__ = StudentTraceback("in your function (its own process):\n" + str(error["traceback"]))
    return exc


def _named_error(name: str) -> type:
    return type(name if name.isidentifier() else "StudentError", (RuntimeError,), {"__module__": "student"})
