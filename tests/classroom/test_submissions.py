"""Hostile submissions as files (issue 37's zip attacks): a zip is read in place, never unpacked, so a member named
``../x`` or ``/x``, a link, a folder too deep, a zip inside the zip or a member that inflates past the notebook limit
goes nowhere and costs one line; a student's folder with a link to the solutions or a FIFO is read as nothing.
(``course_lib/classroom/grading/submissions.py``; the graded class of ``test_grade.py`` runs the same files end to
end.)"""

from __future__ import annotations

import json
import os
import stat
import zipfile
from pathlib import Path

from course_lib.classroom.grading.submissions import NOTEBOOK_LIMIT, NOT_SUBMITTED, find_students

NAME = "01_topology.ipynb"
NOTEBOOK = json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def _zip(path: Path, members: dict[str, bytes], links: dict[str, str] = ()) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        for name, target in dict(links).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, target)
    return path


def _one(folder: Path):
    subs, skipped = find_students(folder)
    assert len(subs) == 1 and not skipped, (subs, skipped)
    return subs[0].notebook("01", NAME)


def test_members_outside_the_archive_links_and_deep_folders_are_not_read(tmp_path):
    for n, name in enumerate(["../../" + NAME, "/etc/" + NAME, "a/b/c/d/" + NAME, ".hidden/" + NAME,
                              "__MACOSX/" + NAME]):
        folder = tmp_path / str(n)
        folder.mkdir()
        _zip(folder / "eve.zip", {name: NOTEBOOK.encode()})
        assert _one(folder) == (None, NOT_SUBMITTED), name
    folder = tmp_path / "link"
    folder.mkdir()
    _zip(folder / "eve.zip", {}, links={NAME: "/work/solutions/" + NAME})
    assert _one(folder) == (None, NOT_SUBMITTED)
    assert not (tmp_path / NAME).exists() and not Path("/etc", NAME).exists()  # nothing was unpacked anywhere


def test_a_zip_inside_the_zip_is_not_opened_and_the_notebook_next_to_it_is_graded(tmp_path):
    inner = _zip(tmp_path / "inner.zip", {NAME: b"{not json"})
    _zip(tmp_path / "eve.zip", {"nested.zip": inner.read_bytes(), "my-labs/" + NAME: NOTEBOOK.encode()})
    inner.unlink()
    notebook, why = _one(tmp_path)
    assert why == "" and notebook["cells"] == []


def test_a_member_that_inflates_past_the_limit_is_one_line_and_is_not_read_whole(tmp_path):
    _zip(tmp_path / "eve.zip", {NAME: b" " * (NOTEBOOK_LIMIT + 1024)})  # ~33 MiB of spaces deflate to ~33 KB
    assert (tmp_path / "eve.zip").stat().st_size < 1 << 20
    notebook, why = _one(tmp_path)
    assert notebook is None and why == f"not graded: eve.zip/{NAME}: larger than {NOTEBOOK_LIMIT >> 20} MiB", why


def test_a_folder_with_a_link_to_the_solutions_or_a_fifo_gives_nothing_to_read(tmp_path):
    solution = tmp_path / "solutions" / NAME
    solution.parent.mkdir()
    solution.write_text(NOTEBOOK)
    subs = tmp_path / "submissions"
    (subs / "eve").mkdir(parents=True)
    os.symlink(solution, subs / "eve" / NAME)
    assert _one(subs) == (None, NOT_SUBMITTED)
    (subs / "eve" / NAME).unlink()
    os.mkfifo(subs / "eve" / NAME)
    notebook, why = _one(subs)
    assert notebook is None and "is not a regular file" in why, why
