"""The student workspace: your own copies of the labs, which no command ever overwrites.

``labs/`` is what the course releases (generated from ``solutions/``, tested by
nbval, replaced by ``git pull``). Students work in ``my-labs/`` (git-ignored),
the same split as nbgrader's release and submission folders.
``python -m course_lib workspace`` (run by ``make lab``) brings the workspace
up to date with ``labs/``:

* a lab the workspace lacks is copied in;
* a lab that changed in ``labs/`` replaces the student's copy only when the
  copy's stamp (:mod:`course_lib.classroom.notebooks.stamp`) proves it untouched since it
  was copied -- then it holds no work, and replacing it loses nothing;
* otherwise the new version arrives beside it, as ``NN_name.updated.ipynb``
  (``.updated-2``, ... when that name holds work), once per new version.

``--fresh 03`` writes a fresh copy of one lab beside the student's
(``my-labs/03_pipeline.fresh.ipynb``), whatever the state of theirs.

    python -m course_lib workspace                 # fill / update my-labs/ from labs/
    python -m course_lib workspace --fresh 03      # a fresh copy of lab 03, beside yours
"""

from __future__ import annotations

import hashlib
from itertools import count
from pathlib import Path
from typing import Iterator, Optional

from course_lib.classroom.notebooks.stamp import is_untouched, read_if_notebook, version
from course_lib.safe_files import check_output_dir, write_atomic
from course_lib.rules import UsageError

DEFAULT_WORKSPACE = "my-labs"
LAB_GLOB = "[0-9][0-9]_*.ipynb"


def names_beside(folder: Path, stem: str, tag: str) -> Iterator[Path]:
    """``folder/stem.tag.ipynb``, then ``stem.tag-2.ipynb``, ``stem.tag-3.ipynb``, ..."""
    yield folder / f"{stem}.{tag}.ipynb"
    for n in count(2):
        yield folder / f"{stem}.{tag}-{n}.ipynb"


def free_name(folder: Path, stem: str, tag: str) -> Path:
    """The first of :func:`names_beside` that does not exist yet."""
    return next(p for p in names_beside(folder, stem, tag) if not p.exists())


def _version_of(path: Path) -> str:
    notebook = read_if_notebook(path)
    if notebook is not None:
        return version(notebook)
    try:
        return "bytes:" + hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def _untouched(path: Path) -> bool:
    notebook = read_if_notebook(path)
    return notebook is not None and is_untouched(notebook)


def _holds(path: Path, data: bytes) -> bool:
    try:
        return path.is_file() and path.read_bytes() == data
    except OSError:
        return False


def release_labs(labs_dir: Path) -> list[Path]:
    """The released labs (``labs/NN_*.ipynb``); a one-line error when there are none."""
    found = sorted(labs_dir.glob(LAB_GLOB)) if labs_dir.is_dir() else []
    if not found:
        raise UsageError(f"--labs {labs_dir}: no {LAB_GLOB} notebooks there; run this from the course folder "
                         f"(or give --labs)")
    return found


def _deliver_beside(release: Path, data: bytes, workspace: Path) -> Optional[Path]:
    """Put a changed lab beside the student's copy; None when this version is already there."""
    new = _version_of(release)
    existing = []
    for candidate in names_beside(workspace, release.stem, "updated"):
        if not candidate.exists():
            break
        if _version_of(candidate) == new:
            return None
        existing.append(candidate)
    target = next((c for c in existing if _untouched(c)), None) or free_name(workspace, release.stem, "updated")
    write_atomic(target, data)
    return target


def sync_lab(release: Path, workspace: Path) -> Optional[str]:
    """Bring one lab into the workspace without touching the student's work; what was done, or None."""
    target, data = workspace / release.name, release.read_bytes()
    if not target.exists():
        write_atomic(target, data)
        return f"added {target}"
    if _holds(target, data) or _version_of(target) == _version_of(release):
        return None  # the student's copy came from this very version of the lab
    if _untouched(target):
        write_atomic(target, data)
        return f"updated {target} (your copy was untouched since it was copied)"
    beside = _deliver_beside(release, data, workspace)
    if beside is None:
        return None
    return (f"{release.name} changed in {release.parent}/: your {target} has your edits and is kept; "
            f"the new version is {beside}")


def sync(labs_dir: Path, workspace: Path) -> list[str]:
    """Bring every released lab into the workspace; one message per file written."""
    releases = release_labs(labs_dir)
    check_output_dir(workspace, what="--dir")
    return [m for m in (sync_lab(release, workspace) for release in releases) if m]


def find_lab(labs_dir: Path, which: str) -> Path:
    """The released lab named by ``which``: its number (``03`` or ``3``), its stem or its file name."""
    releases = release_labs(labs_dir)
    if not which.strip():
        raise UsageError("--fresh '': name a lab, by number (--fresh 03) or name; the labs are "
                         f"{', '.join(p.stem for p in releases)}")
    key = f"{int(which):02d}" if which.isascii() and which.isdigit() else which
    for path in releases:
        if key in (path.name, path.stem) or path.name.startswith(f"{key}_"):
            return path
    raise UsageError(f"--fresh {which}: no such lab in {labs_dir}/; the labs are "
                     f"{', '.join(p.stem for p in releases)}")


def fresh_copy(labs_dir: Path, workspace: Path, which: str) -> str:
    """Write a fresh copy of one lab beside the student's, under a name not yet taken."""
    release = find_lab(labs_dir, which)
    check_output_dir(workspace, what="--dir")
    data = release.read_bytes()
    for candidate in names_beside(workspace, release.stem, "fresh"):
        if _holds(candidate, data):
            return f"{candidate} is already a fresh copy of {release.name} (nothing written)"
        if not candidate.exists():
            write_atomic(candidate, data)
            return f"wrote a fresh copy of {release.name}: {candidate} (your {workspace / release.name} is unchanged)"
    raise AssertionError("unreachable: names_beside never ends")


def add_arguments(parser) -> None:
    parser.add_argument("--dir", default=DEFAULT_WORKSPACE, type=Path,
                        help=f"your workspace (default: {DEFAULT_WORKSPACE}, git-ignored)")
    parser.add_argument("--labs", default="labs", type=Path, help="the released labs (default: labs)")
    parser.add_argument("--fresh", metavar="NN", help="write a fresh copy of lab NN beside yours (e.g. --fresh 03)")


def run(args) -> int:
    if args.dir.resolve() == args.labs.resolve():
        raise UsageError(f"--dir {args.dir} is the labs folder; your workspace must be a folder of its own "
                         f"(default: {DEFAULT_WORKSPACE})")
    if args.fresh is not None:
        print(fresh_copy(args.labs, args.dir, args.fresh))
        return 0
    for message in sync(args.labs, args.dir):
        print(message)
    print(f"{args.dir}/ is your workspace ({len(release_labs(args.labs))} labs): "
          f"a copy holding your work there is never overwritten")
    return 0
