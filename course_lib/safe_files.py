"""Writing files without losing what a person made.

Every command that writes a file goes through this module, so one policy holds
everywhere:

* a command never writes over a file it reads (``inputs``);
* writing over any other existing file needs ``force=True`` (the ``--force`` flag);
* a path that cannot be written (missing or read-only folder, ``/proc``, a folder
  where a file is wanted) is refused *before* any work starts, in one line;
* writes are atomic: a temporary file in the same folder, then ``os.replace``,
  so an interrupted command never leaves half a file behind (:func:`write_atomic`,
  :func:`save_figure_atomic` for a matplotlib figure);
* a command that regenerates a folder of its own outputs (``figures``) recognises
  them by an :class:`OutputLedger` (``.course_outputs.json``: name -> SHA-256 of what
  it wrote): a file still as written may be replaced, anything else needs ``force``;
  a ``.course_outputs.json`` that is not such a ledger is never written over.

Reading goes through one bounded reader too: :func:`read_json` (every JSON file a command
reads: notebooks, ledgers, sweep summaries, ds_config files) refuses, in one line naming the
file, what is not plain JSON or is too large or too deeply nested to handle safely.

Refusals raise :class:`OutputPathError` (a ``ValueError``), which the command
line prints as one line (``error: ...``) and exit code 2.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Union
from course_lib.rules import UsageError

PathLike = Union[str, os.PathLike]


class OutputPathError(UsageError):
    """An output path that must not or cannot be written; the message says why and what to do."""


MAX_JSON_BYTES = 256 * 2**20  # a notebook with its outputs is a few MB; a ds_config a few kB
MAX_JSON_DEPTH = 100          # a notebook nests about 6 levels, a ds_config 4


def _refuse_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise UsageError(f"the key {key!r} appears twice in one object")
        seen[key] = value
    return seen


def _refuse_constant(name):
    raise UsageError(f"{name} is not a JSON number")


def _depth(value) -> int:
    """How deeply ``value`` nests lists and objects (iteratively: no recursion to overflow)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            if level <= MAX_JSON_DEPTH:
                stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def loads_json(text: str, source: str):
    """The JSON value in ``text`` (from ``source``, named in errors); a one-line ``ValueError`` otherwise.

    Refused: invalid JSON, ``NaN``/``Infinity`` (Python writes them, JSON has none), a key given
    twice in one object (the second would silently win), nesting deeper than ``MAX_JSON_DEPTH``."""
    try:
        value = json.loads(text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise UsageError(f"{source}: nested more than {MAX_JSON_DEPTH} levels deep; not a file this course "
                         f"writes or reads") from None
    except ValueError as exc:
        raise UsageError(f"{source}: not plain JSON ({exc})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise UsageError(f"{source}: nested more than {MAX_JSON_DEPTH} levels deep; not a file this course "
                         f"writes or reads")
    return value


def read_json(path: PathLike, what: str = ""):
    """The JSON value in file ``path``, read within bounds; a one-line ``ValueError`` naming the file otherwise.

    ``what`` (e.g. ``"--deepspeed-config"``) prefixes the file's name in errors. Besides
    :func:`loads_json`'s refusals: a file that cannot be read, is not UTF-8, or is larger
    than ``MAX_JSON_BYTES``."""
    path = Path(path)
    source = f"{what} {path}" if what else str(path)
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise UsageError(f"{source}: {size} bytes, more than the {MAX_JSON_BYTES} this course reads "
                             f"as JSON")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UsageError(f"{source}: cannot read it ({exc.strerror or exc})") from None
    return loads_json(text, source)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _check_folder_writable(folder: Path, what: str, target: Path) -> None:
    """``folder`` exists and is a writable folder, or can be created under a writable one."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        raise OutputPathError(f"{what} {target}: {existing} is a file, not a folder; choose another path")
    try:  # a real probe: os.access says yes to root even on /proc or a read-only mount
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise OutputPathError(f"{what} {target}: cannot write in {existing} ({exc.strerror or exc}); "
                              f"choose another path") from None


def check_output_file(path: PathLike, *, force: bool = False, inputs: Iterable[PathLike] = (),
                      what: str = "--out") -> Path:
    """Check, before any work, that ``path`` may be written; return it as a ``Path``.

    Refused (:class:`OutputPathError`): ``path`` is one of ``inputs`` (the files
    the command reads, whatever the spelling: symlinks and ``..`` are resolved);
    ``path`` is a folder; ``path`` exists and ``force`` is false; its folder
    cannot be created or written.
    """
    path = Path(path)
    for source in inputs:
        if _same_file(path, Path(source)) or path.resolve() == Path(source).resolve():
            raise OutputPathError(f"{what} {path} is also an input of this command and would be overwritten; "
                                  f"write the output to another file")
    if path.is_dir():
        raise OutputPathError(f"{what} {path} is a folder; give a file name")
    if path.exists() and not force:
        raise OutputPathError(f"{what} {path} already exists; pass --force to replace it, or choose another name")
    _check_folder_writable(path.parent, what, path)
    return path


def check_output_dir(path: PathLike, *, what: str = "--out") -> Path:
    """Check, before any work, that files can be created in folder ``path``; create it.

    The check is real: a temporary file is made and removed in the nearest
    existing folder, then the folder is created (with its parents) and probed
    the same way, so ``/proc/x``, a read-only
    mount or a file in the way is refused here, not after an hour of training.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{what} {path} is a file, not a folder; choose another path")
    _check_folder_writable(path, what, path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"{what} {path}: cannot create it ({exc.strerror or exc}); "
                              f"choose another folder") from None
    _check_folder_writable(path, what, path)
    return path


def write_atomic(path: PathLike, data: Union[str, bytes]) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` through a temporary file + rename.

    Never a half-written file, whatever interrupts it. The parent folder is
    created; the file gets the usual mode for new files (``0o666`` minus the
    umask), not ``mkstemp``'s 0600. This does not decide *whether* ``path``
    may be replaced: call :func:`check_output_file` first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save_figure_atomic(fig, path: PathLike, **savefig_kwargs) -> Path:
    """``fig.savefig(path, **savefig_kwargs)``, atomically: rendered in memory, then :func:`write_atomic`.

    The format comes from ``path``'s suffix unless ``format=`` is given."""
    path = Path(path)
    savefig_kwargs.setdefault("format", path.suffix.lstrip(".").lower() or None)
    buffer = io.BytesIO()
    fig.savefig(buffer, **savefig_kwargs)
    return write_atomic(path, buffer.getvalue())


def save_and_close_figure(fig, path: PathLike, dpi: int = 80) -> Path:
    """A lab's theory picture: ``fig`` written atomically to ``path`` (tight bounding box, ``dpi``),
    then closed so that a writer drawing many figures does not keep them all in memory."""
    import matplotlib.pyplot as plt

    try:
        return save_figure_atomic(fig, path, dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)


LEDGER_NAME = ".course_outputs.json"


def _is_ledger(value) -> bool:
    """``value`` has a ledger's shape: ``{file name: 64 hex digits}``."""
    return isinstance(value, dict) and all(
        isinstance(name, str) and isinstance(digest, str) and len(digest) == 64
        and all(c in "0123456789abcdef" for c in digest) for name, digest in value.items())


def _sha256(data: Union[str, bytes]) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


class OutputLedger:
    """What a command wrote in ``folder``: ``{name: SHA-256}`` in ``folder/.course_outputs.json``.

    A file is *its own* (:meth:`is_own`) when the ledger names it and its bytes still hash
    to what was recorded: written by the command and changed by nobody since, so replacing
    it loses nothing. A missing ledger counts as empty (nothing is own). A
    ``.course_outputs.json`` that is not a ledger (a person's file, or another tool's) is
    refused when the ledger is opened, before any work: it is never written over.
    """

    def __init__(self, folder: PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LEDGER_NAME
        self.hashes: dict = {}
        if self.path.exists():
            try:
                hashes = read_json(self.path) if self.path.is_file() else None
            except ValueError:
                hashes = None
            if not _is_ledger(hashes):
                raise OutputPathError(f"{self.path} is not a course_lib output ledger ({{file name: SHA-256}}), so "
                                      f"it is not ours to rewrite; move it away or choose another folder")
            self.hashes = hashes

    def is_own(self, name: str) -> bool:
        """``folder/name`` is a file this ledger recorded, with the same bytes."""
        path = self.folder / name
        recorded = self.hashes.get(name)
        return recorded is not None and path.is_file() and _sha256(path.read_bytes()) == recorded

    def record(self, name: str, data: Union[str, bytes]) -> None:
        """Note that ``folder/name`` now holds ``data`` (call :meth:`save` when done)."""
        self.hashes[name] = _sha256(data)

    def save(self) -> Path:
        """Write the ledger (atomically)."""
        return write_atomic(self.path, json.dumps(self.hashes, indent=1, sort_keys=True) + "\n")

    def write(self, files: Mapping[str, Union[str, bytes]]) -> list[Path]:
        """Write ``{name: text or bytes}`` atomically, record each and save the ledger.

        This does not decide whether a name may be replaced: check first (:meth:`is_own`,
        :func:`check_output_file`)."""
        paths = []
        for name, data in files.items():
            paths.append(write_atomic(self.folder / name, data))
            self.record(name, data)
        self.save()
        return paths
