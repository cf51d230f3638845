"""A student's function (or class) as plain data: its source and what it uses, rebuilt where it runs.

The judge never receives the student's objects, only their text: :func:`capture` reads, in the kernel,
the ``def`` (or ``class``) statement the function came from -- from the notebook cell that defined it
(IPython keeps every cell's text in :mod:`linecache`), or from its file -- and the notebook names the
statement uses: modules (by name), functions and classes of importable modules (by
``"module:qualname"``), other functions and classes of the notebook (their own statements, captured the
same way), and values that travel as plain data (:mod:`~course_lib.classroom.checks.plain`: numbers,
lists, tensors, the course's configs). A name whose value does not travel is bound, where the function
runs, to :class:`Unavailable`, which says so when used.

:func:`rebuild` runs those statements in a fresh namespace of a worker process (after the worker has
put its refusals in place, :mod:`~course_lib.classroom.checks.refusals`), so the modules and names are
looked up there, through the worker's import rules. The text is compiled under the file name
a name starting with :data:`STUDENT_FILE`: tracebacks show the student's lines, and a worker recognises the student's frames.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import linecache
import textwrap
import types

from course_lib.classroom.checks import plain
from course_lib.classroom.checks.plain import resolve

STUDENT_FILE = "<your exercise cell"
"""How the file name of the student's compiled code starts (:func:`student_file`)."""


def student_file(name: str) -> str:
    """The file name the statement that defines ``name`` is compiled under."""
    return f"{STUDENT_FILE}: {name}>"


class CaptureError(ValueError):
    """The function cannot be read as a statement (a lambda, a closure, a function made by exec)."""


class Unavailable:
    """A notebook name whose value could not be sent to where the student's function runs."""

    def __init__(self, name: str, type_name: str):
        self._name, self._type_name = name, type_name

    def _refuse(self, *_args, **_kwargs):
        raise NameError(f"`{self._name}` (a {self._type_name} defined in the notebook) cannot be sent to the "
                        f"judge: compute it inside your function, or pass numbers, lists or tensors")

    __call__ = _refuse

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        self._refuse()


def _statement(obj, name: str) -> str:
    """The source of the top-level ``def``/``class`` that made ``obj``."""
    code = getattr(obj, "__code__", None)
    if code is None and isinstance(obj, type):
        code = _class_code(obj)
    if code is None:
        raise CaptureError(f"`{name}` has no source the judge can read: define it with `def` or `class` in a cell")
    lines = linecache.getlines(code.co_filename)
    if not lines:
        raise CaptureError(f"the source of `{name}` is not available (was the cell edited after it ran?): "
                           f"re-run the cell that defines it")
    text = "".join(lines)
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == obj.__name__:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return "".join(lines[first - 1:node.end_lineno])
    raise CaptureError(f"`{name}` is not a top-level `def` or `class` of its cell: define it at the top level "
                       f"of the cell (not inside another function, not with lambda or exec)")


def _names_used(source: str) -> list[str]:
    seen = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id not in seen:
            seen.append(node.id)
    return seen


def _importable(obj) -> str | None:
    """``"module:qualname"`` when importing it gives ``obj`` back (a library or course function or class)."""
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str) or module == "__main__":
        return None
    for qualname in dict.fromkeys((getattr(obj, "__qualname__", None), getattr(obj, "__name__", None))):
        if not isinstance(qualname, str) or "<locals>" in qualname:  # a compiled function's __qualname__ can be
            continue                                                  # its binder's record: its __name__ is tried too
        try:
            if resolve(f"{module}:{qualname}") is obj:
                return f"{module}:{qualname}"
        except (ImportError, AttributeError, ValueError):
            continue
    return None


def _class_code(cls: type):
    """The code object of the first method ``cls`` defines itself (None for ``class F(Base): pass``)."""
    for attr in vars(cls).values():
        code = getattr(getattr(attr, "__func__", attr), "__code__", None)
        if code is not None:
            return code
    return None


def _is_notebook_code(obj) -> bool:
    return (isinstance(obj, (types.FunctionType, type))) and getattr(obj, "__module__", None) == "__main__"


def capture(fn, name: str | None = None) -> dict:
    """The plain description of the student's ``fn`` (see the module docstring)."""
    name = name or getattr(fn, "__name__", "your function")
    if isinstance(fn, type) and _is_notebook_code(fn) and _class_code(fn) is None:
        fn = fn.__mro__[1]  # `class F(Base): pass` is Base: judged (and refused) as Base
    if not _is_notebook_code(fn):
        where = _importable(fn)
        if where is None:
            raise CaptureError(f"`{name}` is a {type(fn).__name__}, not a function of the notebook: write it with "
                               f"`def {name}(...)` in a cell")
        return {"name": name, "ref": where}
    if getattr(fn, "__closure__", None):
        raise CaptureError(f"`{name}` is defined inside another function: define it at the top level of its cell")
    defs, values, modules, refs, unavailable = [], {}, {}, {}, {}
    pending, done = [(fn.__name__, fn)], set()
    while pending:
        def_name, obj = pending.pop()
        if def_name in done:
            continue
        done.add(def_name)
        source = _statement(obj, def_name)
        defs.append([def_name, source])
        space = obj.__globals__ if hasattr(obj, "__globals__") else vars(inspect.getmodule(obj) or builtins)
        if isinstance(obj, type):
            for attr in vars(obj).values():
                space = getattr(getattr(attr, "__func__", attr), "__globals__", space)
        for used in _names_used(source):
            if used in done or used not in space or used in values or used in modules or used in refs:
                continue
            value, builtin = space[used], getattr(builtins, used, object())
            if value is builtin or getattr(value, "__wrapped__", None) is builtin:  # IPython's own `open` wraps it
                continue
            if isinstance(value, types.ModuleType):
                modules[used] = value.__name__
            elif _is_notebook_code(value):
                pending.append((used, value))
            elif (where := _importable(value)) is not None:
                refs[used] = where
            else:
                encoded = plain.encode(value)
                if isinstance(encoded, dict) and encoded.get("$") == "opaque":
                    unavailable[used] = type(value).__name__
                else:
                    values[used] = encoded
    defaults = plain.encode(fn.__defaults__) if getattr(fn, "__defaults__", None) else None
    return {"name": fn.__name__, "defs": defs[::-1], "values": values, "modules": modules, "refs": refs,
            "unavailable": unavailable, "defaults": defaults}


def values_of(captured: dict) -> dict:
    """The plain values the student's function uses, decoded (before the refusals: a course config's class
    is looked up here, not imported under them)."""
    return {name: plain.decode(value) for name, value in captured.get("values", {}).items()}


def rebuild(captured: dict, values: dict | None = None):
    """The student's function, rebuilt in this process from :func:`capture`'s description (``values``: what
    :func:`values_of` decoded)."""
    if "ref" in captured:
        return resolve(captured["ref"])
    space = {"__name__": "__student__", "__builtins__": builtins}
    space.update(values_of(captured) if values is None else values)
    for name, module in captured["modules"].items():
        space[name] = importlib.import_module(module)
    for name, path in captured["refs"].items():
        space[name] = resolve(path)
    for name, type_name in captured["unavailable"].items():
        space[name] = Unavailable(name, type_name)
    for def_name, source in captured["defs"]:
        source = textwrap.dedent(source)
        filename = student_file(def_name)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), space)  # noqa: S102 - the student's own code, in a worker
    fn = space[captured["name"]]
    if captured.get("defaults") is not None:
        fn.__defaults__ = plain.decode(captured["defaults"])
    return fn

