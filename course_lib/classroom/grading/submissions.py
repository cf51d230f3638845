"""A class's submissions: one folder or zip file per student, holding their lab notebooks.

``SUBMISSIONS/alice/`` (the notebooks anywhere up to three folders down, e.g. ``alice/my-labs/``) or
``SUBMISSIONS/bob.zip``; the student is the folder's name or the zip's stem. A zip is read in
place, never unpacked, so a member named ``../../x`` or a link goes nowhere. Hidden files and folders
(``.ipynb_checkpoints``), links and anything else are skipped. A student's notebook for lab NN is the
file named like the official lab (``03_pipeline.ipynb``), else the one ``03_*.ipynb`` they have;
several of those, a file that is not a notebook, or no file at all are one line each
(:meth:`Submission.notebook`), graded as such, and the class goes on.
"""

from __future__ import annotations

import os
import re
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from course_lib.safe_files import loads_json
from course_lib.rules import UsageError

NOTEBOOK_LIMIT = 32 << 20
"""The largest notebook read (a lab with its outputs is a few MB)."""
DEPTH = 3
NOT_SUBMITTED = "not submitted"


@dataclass(frozen=True)
class Submission:
    """One student's submission: ``student`` (their name) and ``path`` (their folder or zip file)."""

    student: str
    path: Path

    def _files(self) -> dict[str, int]:
        """``{path inside the submission: depth}`` of every notebook-like file in it."""
        if self.path.is_dir():
            found = {}
            for top, dirs, files in os.walk(self.path):
                depth = len(Path(top).relative_to(self.path).parts)
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and depth < DEPTH
                                 and not os.path.islink(os.path.join(top, d)))
                for name in files:
                    full = Path(top) / name
                    if name.endswith(".ipynb") and not name.startswith(".") and not full.is_symlink():
                        found[full.relative_to(self.path).as_posix()] = depth
            return found
        with zipfile.ZipFile(self.path) as archive:
            return {info.filename: len(PurePosixPath(info.filename).parts) - 1 for info in archive.infolist()
                    if _plain_member(info)}

    def notebook(self, number: str, name: str) -> tuple[dict | None, str]:
        """``(notebook, "")`` for lab ``number`` (official file ``name``), or ``(None, why not)``."""
        where = f"{self.path.name}"
        try:
            files = self._files()
        except (OSError, zipfile.BadZipFile) as exc:
            return None, f"not graded: {where} cannot be read ({exc})"
        mine = {p: d for p, d in files.items() if re.fullmatch(rf"{number}_[^/]*\.ipynb", PurePosixPath(p).name)}
        exact = sorted((d, p) for p, d in mine.items() if PurePosixPath(p).name == name)
        if exact:
            chosen = exact[0][1]
        elif len(mine) == 1:
            chosen = next(iter(mine))
        elif mine:
            return None, (f"not graded: several notebooks for lab {number} ({', '.join(sorted(mine))}); "
                          f"keep the one to grade as {name}")
        else:
            return None, NOT_SUBMITTED
        source = f"{where}/{chosen}"
        try:
            text = self._read(chosen)
            notebook = loads_json(text, source)
        except OSError as exc:
            return None, f"not graded: {source} cannot be read ({exc.strerror or exc})"
        except ValueError as exc:
            return None, f"not graded: {exc}"
        if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
            return None, f"not graded: {source} is not a notebook (no 'cells' list)"
        return notebook, ""

    def _read(self, member: str) -> str:
        if self.path.is_dir():
            # O_NONBLOCK: opening a FIFO must not wait for a writer (it would hang the whole grading)
            fd = os.open(self.path / member, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise UsageError(f"{self.path.name}/{member} is not a regular file (a FIFO, a device or a "
                                     f"socket); submit the notebook file itself")
                data = f.read(NOTEBOOK_LIMIT + 1)
        else:
            with zipfile.ZipFile(self.path) as archive, archive.open(member) as f:
                data = f.read(NOTEBOOK_LIMIT + 1)
        if len(data) > NOTEBOOK_LIMIT:
            raise UsageError(f"{self.path.name}/{member}: larger than {NOTEBOOK_LIMIT >> 20} MiB")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{self.path.name}/{member}: not UTF-8 text (byte {exc.start})") from None


def _plain_member(info: zipfile.ZipInfo) -> bool:
    """A regular file of a zip, not hidden, not a link, not above the archive, at most DEPTH folders down."""
    parts = PurePosixPath(info.filename).parts
    mode = info.external_attr >> 16
    return (not info.is_dir() and info.filename.endswith(".ipynb") and len(parts) - 1 <= DEPTH
            and not any(p.startswith(".") or p in ("..", "__MACOSX") for p in parts)
            and not info.filename.startswith("/") and not stat.S_ISLNK(mode))


def find_students(folder: Path) -> tuple[list[Submission], list[str]]:
    """Every student's submission in ``folder`` (by name), and one line per entry that is skipped."""
    subs: dict[str, Submission] = {}
    skipped = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and not entry.is_symlink():
            name = entry.name
        elif entry.is_file() and not entry.is_symlink() and entry.suffix == ".zip":
            name = entry.stem
        else:
            skipped.append(f"skipped {entry.name}: a submission is a student's folder or .zip file")
            continue
        if name in subs:
            skipped.append(f"skipped {entry.name}: {subs[name].path.name} is {name}'s submission")
            continue
        subs[name] = Submission(name, entry)
    return [subs[name] for name in sorted(subs)], skipped
