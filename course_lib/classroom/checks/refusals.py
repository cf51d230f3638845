"""What the student's code may not use where the judge runs it: the exercise's answer, in any form.

For an exercise, :func:`prepare` (in the judge, before any student code runs) collects

* the course's own implementations of the answer (:func:`~course_lib.classroom.checks.references.references_for`):
  every name they are bound to in a loaded ``course_lib`` module is replaced, while the student's code
  runs, by a stand-in that raises :class:`Refused` naming it;
* the real libraries that compute it (:data:`~course_lib.classroom.checks.references.LIBRARIES`:
  megatron-core's ``parallel_state``/``RankGenerator`` and MoE utilities, DeepSpeed's config, torch's
  DCP planner helpers): removed from ``sys.modules`` and from their parent packages, their objects
  replaced where course or torch modules hold them, and refused by an import hook;
* the checker modules themselves (their truth, their input generators): removed from ``sys.modules``
  and refused by the import hook, as are the references' modules re-imported under another name;
* the files of all of these, and the course's solutions: not readable (Landlock, where the kernel has it,
  :func:`course_lib.classroom.grading.landlock.reading_denied_ruleset`), so ``exec(open(...).read())``
  or ``importlib.reload`` finds nothing either.

A process that runs nothing but the student's code from then on -- the judge's workers, and the student process
forked from a rank of a checker launch (:mod:`~course_lib.classroom.checks.student_process`) -- applies them for
good (:meth:`Refusals.apply`): code there that undoes a refusal (puts a name back, removes the import hook) finds
the references' and checkers' code disarmed, the checker modules' data forgotten. Where the checker's own code
runs after the student's code in the same process (a rank rebuilding the student's function before it forks the
student process, :meth:`Refusals.as_student`), they are applied around that block (:meth:`Refusals.around`):
the file rule stays, the names come back. Every refusal is recorded
(:attr:`Refusals.refused`), so the verdict names it even when the student's code caught the exception.
"""

from __future__ import annotations

import os

import contextlib
import functools
import importlib.util
import sys
import threading
import types
from pathlib import Path

from course_lib.classroom.checks.student_code import STUDENT_FILE
from course_lib.classroom.checks.tamper_guard import ORIGINAL_SIGNATURE, code_signature, keep_guarding

REFUSED_MARK = "[refused]"
_CHECKS = "course_lib.classroom"
_REPO = Path(__file__).resolve().parents[3]


class Refused(ImportError):
    """The student's code reached for something that computes the exercise's answer."""


def _student_on_stack() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(STUDENT_FILE):
            return True
        frame = frame.f_back
    return False


def _matches(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class _Finder:
    """An import hook: refuses the listed modules to the student's code (and to threads it started)."""

    def __init__(self, refusals: "Refusals"):
        self.refusals = refusals

    def find_spec(self, name, path=None, target=None):
        r = self.refusals
        if not r.active or not _matches(name, r.modules):
            return None
        if r.always or threading.current_thread() is not threading.main_thread() or _student_on_stack():
            r.note(name)
            raise Refused(f"{REFUSED_MARK} `import {name}`: {r.why(name)}")
        return None


class _RefusedName:
    """What a refused name is bound to while the student's code runs: calling it, or reading or replacing any
    attribute (its ``__code__``, a method), raises :class:`Refused` and is recorded."""

    def __init__(self, refusals: "Refusals", name: str):
        object.__setattr__(self, "_r", (refusals, name))

    def _refuse(self):
        refusals, name = object.__getattribute__(self, "_r")
        refusals.note(name)
        return Refused(f"{REFUSED_MARK} {name}: {refusals.why(name)}")

    def __call__(self, *_args, **_kwargs):
        raise self._refuse()

    def __getattr__(self, attr):
        raise self._refuse()

    def __setattr__(self, attr, value):  # a patch of the reference (``RankGrid.groups_of = ...``) reaches for it too
        raise self._refuse()

    def __repr__(self) -> str:
        return f"<refused: {object.__getattribute__(self, '_r')[1]}>"


class Refusals:
    """The refusals of one exercise (see the module docstring)."""

    def __init__(self, exercise: str, libraries: tuple, references: tuple):
        self.exercise = exercise
        self.libraries = libraries
        self.modules = (*libraries, _CHECKS)
        self.refused: list[str] = []
        self.active = self.always = self.applied = False
        self._stubs = self._find_bindings(references)
        self._ruleset = None
        self._removed: dict = {}
        self._files = self._denied_files(references)

    # ------------------------------------------------------------------ what is refused
    def why(self, name: str) -> str:
        if _matches(name, (_CHECKS,)):
            return "the checker's own code cannot run inside your function"
        return "it computes this exercise's answer: the exercise is to write it yourself"

    def note(self, name: str) -> None:
        if name not in self.refused:
            self.refused.append(name)

    def _stub(self, name: str):
        return _RefusedName(self, name)

    def _find_bindings(self, references) -> list:
        """``(owner, attribute, original, stand-in)`` for every name a reference or a refused library
        object is bound to in a loaded course module (and, for a library module, its siblings)."""
        wanted = {}
        for ref in references:
            wanted[id(ref)] = f"{getattr(ref, '__module__', '?')}.{getattr(ref, '__qualname__', '?')}"
        scan_prefixes = ["course_lib"] + [lib.rpartition(".")[0] for lib in self.libraries if "." in lib]
        bindings = []
        for module_name, module in list(sys.modules.items()):
            if module is None or not _matches(module_name, scan_prefixes) or _matches(module_name, self.modules):
                continue
            for attr, value in list(vars(module).items()):
                name = wanted.get(id(value)) or self._library_name(value)
                if name:
                    bindings.append((module, attr, value, self._stub(name)))
        for ref in references:  # a method named as a reference (Class.forward): replaced on its class
            owner_name, _, attr = getattr(ref, "__qualname__", "").rpartition(".")
            owner = sys.modules.get(getattr(ref, "__module__", ""))
            for part in owner_name.split(".") if owner_name else ():
                owner = getattr(owner, part, None)
            raw = vars(owner).get(attr) if isinstance(owner, type) else None
            if raw is ref or (raw is not None and getattr(raw, "__func__", None) is ref):  # a staticmethod's too
                bindings.append((owner, attr, raw, self._stub(wanted[id(ref)])))
        return bindings

    def _library_name(self, value) -> str | None:
        try:
            name = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
        except Exception:  # noqa: BLE001 - an object whose attributes raise
            return None
        if isinstance(name, str) and _matches(name, self.libraries):
            return name if isinstance(value, type(sys)) else f"{name}.{getattr(value, '__qualname__', '?')}"
        return None

    def _denied_files(self, references) -> list:
        """The paths the file rule denies; :attr:`_file_names` says what each one is, for the hint."""
        named = {Path(__file__).resolve().parent: "course_lib.classroom.checks",
                 _REPO / "solutions": "a copy of the course's solutions (solutions/)",
                 _REPO / "tests": "a copy of the course's tests (tests/)"}
        named.update((path, "git's copy of the course (.git)") for path in _git_dirs(_REPO))
        for ref in references:
            module = sys.modules.get(getattr(ref, "__module__", ""))
            path = getattr(module, "__file__", None)
            if path:
                path = Path(path)
                parts = path.parts
                shown = "/".join(parts[len(parts) - 1 - parts[::-1].index("course_lib"):]) if "course_lib" in parts \
                    else module.__name__
                named[path] = shown
                named.update((pyc, shown) for pyc in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"))
        for lib in self.libraries:
            try:
                spec = importlib.util.find_spec(lib)
            except (ImportError, ValueError):
                spec = None
            if spec is not None and spec.origin and spec.has_location:
                origin = Path(spec.origin)
                named[origin.parent if origin.name == "__init__.py" else origin] = lib
            elif spec is not None:  # a namespace package (megatron): every folder it is made of
                named.update((Path(p), lib) for p in spec.submodule_search_locations or ())
        self._file_names = {str(path): name for path, name in named.items()}
        return sorted(named)

    def note_denied(self, exc: BaseException) -> None:
        """Record, as a refusal, a denied file the student's code tried to read: ``exc`` (or an exception it was
        raised from) names one (a ``PermissionError``'s file, an ``ImportError``'s path or message)."""
        seen = 0
        while exc is not None and seen < 8:
            texts = [str(getattr(exc, attr, None) or "") for attr in ("filename", "path")] + [str(exc)]
            for path, name in getattr(self, "_file_names", {}).items():
                if any(path in text for text in texts) and isinstance(exc, (OSError, ImportError)):
                    self.note(f"reading {name}")
                    return
            exc, seen = exc.__cause__ or exc.__context__, seen + 1

    # ------------------------------------------------------------------ applying them
    def _fence_files(self) -> None:
        import course_lib.classroom.grading.landlock as landlock

        if self._ruleset is None:
            private_tempdir()
            self._ruleset = landlock.reading_denied_ruleset(self._files)
        if self._ruleset >= 0 and not getattr(self, "_fenced", False):
            landlock.restrict_self(self._ruleset)
            self._fenced = True

    def prepare_files(self) -> None:
        """Build the Landlock ruleset now (in the judge), so each worker only applies it."""
        import course_lib.classroom.grading.landlock as landlock

        if self._ruleset is None:
            private_tempdir()
            self._ruleset = landlock.reading_denied_ruleset(self._files)

    def ruleset_fd(self) -> int:
        """The prepared Landlock ruleset's file descriptor (-1 when there is none)."""
        return -1 if self._ruleset is None else self._ruleset

    @contextlib.contextmanager
    def around(self):
        """The refusals in place for the block (the file rule for good); names restored afterwards. In a process
        where :meth:`apply` ran, nothing: they are in place already, and its exit must not put the originals back
        nor switch the import hook off."""
        if self.applied:
            yield self
            return
        self._fence_files()
        removed = {name: module for name, module in sys.modules.items() if module is not None
                   and _matches(name, self.modules)}
        self._removed = removed
        parents = []
        for name, module in removed.items():
            parent = sys.modules.get(name.rpartition(".")[0])
            attr = name.rpartition(".")[2]
            if parent is not None and vars(parent).get(attr) is module:
                parents.append((parent, attr, module))
        finder = _Finder(self)
        try:
            for name in removed:
                del sys.modules[name]
            for parent, attr, module in parents:  # ``torch.distributed.checkpoint.planner_helpers`` refuses too
                setattr(parent, attr, self._stub(module.__name__))
            for owner, attr, _, stub in self._stubs:
                setattr(owner, attr, stub)
            sys.meta_path.insert(0, finder)
            self.active = True
            yield self
        finally:
            self.active = False
            sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]
            for owner, attr, original, _ in self._stubs:
                setattr(owner, attr, original)
            for parent, attr, module in parents:
                setattr(parent, attr, module)
            sys.modules.update(removed)

    @contextlib.contextmanager
    def as_student(self):
        """The refusals in place for the block, every import in it counted as the student's: the modules and names
        the student's cell imported are looked up while their code is rebuilt on a rank, before any of it runs."""
        with self.around():
            always, self.always = self.always, True
            try:
                yield self
            finally:
                self.always = always

    def apply(self, handed_over: tuple = ()) -> None:
        """The refusals for good (a process that runs nothing but the student's code from now on): also the code of
        every reference and checker function this process inherited is replaced, so one found through
        ``gc.get_objects()``, a frame or a module's dict refuses too. ``handed_over`` is what the checker gives
        the student's code or runs after it there (see :func:`_spared`): it keeps its code. Once applied,
        :meth:`around` and :meth:`apply` do nothing."""
        if self.applied:
            return
        self.always = True
        self._for_good = self.around()  # kept: a context manager collected as garbage would run its exit
        self._for_good.__enter__()
        self.applied = True
        keep_guarding(self._removed)  # a patch of a checker module is still undone and named
        references = [getattr(original, "__func__", original) for _, _, original, _ in self._stubs]
        found = list(references)
        checkers = {name: module for name, module in self._removed.items()
                    if _matches(name, (_CHECKS + ".checks",)) and name.rpartition(".")[2] not in _MACHINERY}
        for name, module in checkers.items():
            found += [v for v in list(vars(module).values()) if getattr(v, "__module__", None) == name]
        found += _held_only_by(self._removed, self.libraries)
        functions, classes = _spared(handed_over)
        for obj in found:
            if id(obj) in functions or (isinstance(obj, type) and any(_subclass(kept, obj) for kept in classes)):
                continue
            _disarm(obj, f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}",
                    constructor=any(obj is ref for ref in references))
        _forget_data(checkers, functions.values())


_MACHINERY = {"workers", "plain", "student_code", "refusals", "records", "judge", "judge_client", "wire",
              "verdicts", "tamper_guard", "exercise", "checks", "student_process"}
"""Modules of the checks package whose code a worker or a student process runs itself (reading requests,
forwarding ops, encoding replies): never disarmed."""


def _subclass(kept: type, obj: type) -> bool:
    try:
        return issubclass(kept, obj)
    except TypeError:  # a typing.Protocol that is not runtime-checkable
        return False


def _held_only_by(removed: dict, libraries: tuple) -> list:
    """The functions and classes of the refused libraries' modules in ``removed`` that no module left in
    ``sys.modules`` holds: taken out of ``sys.modules``, those modules stay alive (gc finds them), and their
    functions would still compute the answer (torch's DCP planner helpers). What another module holds stays armed
    (a library may have wrapped a torch function that every student calls)."""
    refused = [(name, module) for name, module in removed.items() if _matches(name, libraries)]
    if not refused:  # most exercises refuse no library: spare the read of every module's dict (in a fresh
        return []    # fork, copies of the pages it touches: ~40 ms with torch loaded)
    held = {id(v) for module in list(sys.modules.values()) if module is not None
            for v in list(getattr(module, "__dict__", {}).values())}
    found = []
    for name, module in refused:
        found += [v for v in list(vars(module).values()) if getattr(v, "__module__", None) == name
                  and (callable(v) or isinstance(v, type)) and id(v) not in held]
    return found


def _forget_data(checkers: dict, spared) -> None:
    """Empty the checker modules' dicts of what no spared function names: their answer keys and fixed cases
    (review's ``QUESTIONS``) are data, which disarming code does not reach, and the modules stay alive in the
    process (gc finds them)."""
    used: set = set()
    for fn in spared:
        codes = [getattr(fn, "__code__", None)]
        for code in codes:
            if code is not None:
                used.update(code.co_names)
                codes.extend(c for c in code.co_consts if isinstance(c, type(code)))
    for module in checkers.values():
        for key in [k for k in list(vars(module)) if not (k.startswith("__") or k in used)]:
            del vars(module)[key]


def _spared(handed_over) -> tuple[dict, tuple]:
    """What :meth:`Refusals.apply` leaves armed: ``({id: function}, classes)``. The checker hands the student's
    code objects (an argument, nested in lists, tuples and dicts) and may run a hook of its own after the call
    (a ``summarize``): the classes of the objects and the classes themselves keep their methods; a function (a
    ``functools.partial``'s too) keeps its code, and so do the checker functions and classes its code names
    (the helpers a hook calls), and theirs."""
    functions: dict = {}
    classes: set = set()
    todo, seen = list(handed_over), set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _RefusedName):  # a stand-in: nothing to spare, and reading it would refuse
            continue
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, functools.partial):
            todo.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif isinstance(obj, type):
            classes.add(obj)
        elif hasattr(getattr(obj, "__func__", obj), "__code__"):
            fn = getattr(obj, "__func__", obj)
            functions[id(fn)] = fn
            todo.extend(_checker_code_named_by(fn))
        else:
            classes.add(type(obj))
    return functions, tuple(classes)


def _checker_code_named_by(fn) -> list:
    """The functions and classes of checker modules that ``fn``'s code (and the code nested in it) names as
    globals, and the checker functions its closure holds."""
    codes, named = [fn.__code__], []
    for code in codes:
        codes.extend(c for c in code.co_consts if isinstance(c, type(code)))
        named += [fn.__globals__.get(name) for name in code.co_names]
    for cell in fn.__closure__ or ():
        try:
            named.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return [v for v in named if callable(v) and _matches(getattr(v, "__module__", None) or "", (_CHECKS + ".checks",))]


def _git_dirs(repo: Path) -> list:
    """The repository's git folders (its ``.git``; for a worktree, the folder its ``.git`` file names and the
    common one): their objects hold every file of the course, solutions included (``git show HEAD:...``)."""
    dot = repo / ".git"
    if not dot.is_file():
        return [dot]
    try:
        gitdir = Path(dot.read_text().split("gitdir:", 1)[1].strip())
    except (OSError, IndexError):
        return [dot]
    gitdir = gitdir if gitdir.is_absolute() else (repo / gitdir).resolve()
    common = gitdir / "commondir"
    found = [dot, gitdir]
    if common.is_file():
        found.append((gitdir / common.read_text().strip()).resolve())
    return found


_MESSAGE_SLOT = "\0the refusal's message\0"
_REFUSED_CODE = next(c for c in compile(f"def refused(*args, **kwargs):\n    raise ImportError({_MESSAGE_SLOT!r})\n",
                                        "<refused>", "exec").co_consts if isinstance(c, types.CodeType))
"""The code a disarmed function runs, compiled once (outside the checker's files: the guard would read a call of
checker code as the course's); :func:`_disarm` puts its message in (``code.replace``: a compile per function
disarmed cost a student process ~15 µs each, hundreds of times)."""


def _disarm(obj, name: str, constructor: bool = False) -> None:
    """Make ``obj`` (a function, or each method of a class) raise :class:`Refused` when called; with
    ``constructor`` (a reference class: building one computes the answer, as ``RankGrid``'s strides do) its
    ``__init__`` too."""
    functions = [obj] if callable(obj) and hasattr(obj, "__code__") else []
    if isinstance(obj, type):
        for key, attr in vars(obj).items():
            if key.startswith("__") and not (constructor and key == "__init__"):  # comparison, printing: no answer
                continue
            attr = getattr(attr, "__func__", attr)
            attr = attr.fget if isinstance(attr, property) else attr
            if hasattr(attr, "__code__"):
                functions.append(attr)
    message = f"{REFUSED_MARK} {name}: it computes this exercise's answer (or is the checker's own code)"
    refused = _REFUSED_CODE.replace(co_consts=tuple(message if c == _MESSAGE_SLOT else c
                                                    for c in _REFUSED_CODE.co_consts))
    for fn in functions:
        if not fn.__closure__:
            original = fn.__code__
            try:
                fn.__code__ = refused
            except (ValueError, TypeError):
                continue
            setattr(fn, ORIGINAL_SIGNATURE, code_signature(original))  # a copy of it is still named as one


def prepare(exercise: str) -> Refusals:
    """The :class:`Refusals` of ``exercise`` (in the judge: resolves the references, reads no student code)."""
    from course_lib.classroom.checks.references import LIBRARIES, references_for

    return Refusals(exercise, LIBRARIES.get(exercise, ()), references_for(exercise))


def refused_hint(names: list) -> str:
    """The verdict line for a function whose code reached for refused names."""
    return f"{REFUSED_MARK} your function used {', '.join(names[:3])}: " + (
        "the checker's own code cannot run inside your function" if all(n.startswith(_CHECKS) for n in names)
        else "it computes this exercise's answer, and the exercise is to write it yourself")


def private_tempdir() -> None:
    """Give this process (and the workers forked from it) a temp folder that exists before the ruleset is
    built: the ruleset allows reading only the entries an ancestor of a denied path holds at that moment, so
    with the course checked out under /tmp a temp folder made later in /tmp could not be read back."""
    import atexit
    import shutil
    import tempfile

    if os.environ.get("COURSE_JUDGE_TMPDIR") == tempfile.gettempdir():
        return
    folder = tempfile.mkdtemp(prefix="course-judge-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["TMPDIR"] = os.environ["COURSE_JUDGE_TMPDIR"] = tempfile.tempdir = folder
