"""The student workspace (course_lib.classroom.notebooks.workspace): labs are copied in, never copied over work.

Each test builds a released labs/ folder in tmp_path from stamped notebooks, the way
the generator writes them, and plays a student's edits with nbformat, the way Jupyter saves.
"""

import re
from pathlib import Path

import nbformat
import pytest

from course_lib.__main__ import main
from course_lib.classroom.notebooks.stamp import dumps, is_untouched, read_notebook, stamped

ROOT = Path(__file__).resolve().parents[2]


def release(course: Path, name: str, text: str) -> bytes:
    """Publish labs/<name> with one code cell ``text``, stamped like the generator's labs."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {name}"), nbformat.v4.new_code_cell(text)]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i:03d}"
    path = course / "labs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(stamped(nb)), encoding="utf-8")
    return path.read_bytes()


def student_edits(path: Path, answer: str) -> bytes:
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = answer
    nbformat.write(nb, path)
    return path.read_bytes()


@pytest.fixture
def course(tmp_path, monkeypatch):
    release(tmp_path, "01_map.ipynb", "raise NotImplementedError('v1')")
    release(tmp_path, "03_pipeline.ipynb", "raise NotImplementedError('v1')")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def workspace(capsys, *args):
    capsys.readouterr()
    code = main(["workspace", *args])
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err.strip()


def files(course):
    return sorted(p.name for p in (course / "my-labs").iterdir())


def test_missing_labs_are_copied_in_and_a_second_run_writes_nothing(course, capsys):
    code, out, _ = workspace(capsys)
    assert code == 0 and out[:2] == ["added my-labs/01_map.ipynb", "added my-labs/03_pipeline.ipynb"]
    assert (course / "my-labs/03_pipeline.ipynb").read_bytes() == (course / "labs/03_pipeline.ipynb").read_bytes()
    release(course, "04_new.ipynb", "print('new lab after a git pull')")
    code, out, _ = workspace(capsys)
    assert out[0] == "added my-labs/04_new.ipynb" and len(out) == 2  # the new lab, then the summary line
    assert files(course) == ["01_map.ipynb", "03_pipeline.ipynb", "04_new.ipynb"]


def test_an_untouched_copy_is_replaced_by_the_changed_lab(course, capsys):
    workspace(capsys)
    nb = nbformat.read(course / "my-labs/03_pipeline.ipynb", as_version=4)
    nbformat.write(nb, course / "my-labs/03_pipeline.ipynb")  # opened and saved in Jupyter, nothing changed
    new = release(course, "03_pipeline.ipynb", "raise NotImplementedError('v2')")
    code, out, _ = workspace(capsys)
    assert out[0] == "updated my-labs/03_pipeline.ipynb (your copy was untouched since it was copied)"
    assert (course / "my-labs/03_pipeline.ipynb").read_bytes() == new
    assert files(course) == ["01_map.ipynb", "03_pipeline.ipynb"]


def test_an_edited_copy_is_kept_and_each_new_version_arrives_beside_it_once(course, capsys):
    workspace(capsys)
    mine = student_edits(course / "my-labs/03_pipeline.ipynb", "answer = 42")
    code, out, _ = workspace(capsys)
    assert len(out) == 1, "the lab has not changed since it was copied: nothing to deliver"
    v2 = release(course, "03_pipeline.ipynb", "raise NotImplementedError('v2')")
    code, out, _ = workspace(capsys)
    assert out[0] == ("03_pipeline.ipynb changed in labs/: your my-labs/03_pipeline.ipynb has your edits and is "
                      "kept; the new version is my-labs/03_pipeline.updated.ipynb")
    assert (course / "my-labs/03_pipeline.ipynb").read_bytes() == mine
    assert (course / "my-labs/03_pipeline.updated.ipynb").read_bytes() == v2
    assert len(workspace(capsys)[1]) == 1, "delivered once, not on every run"
    v3 = release(course, "03_pipeline.ipynb", "raise NotImplementedError('v3')")
    workspace(capsys)
    assert (course / "my-labs/03_pipeline.updated.ipynb").read_bytes() == v3, "an untouched update is refreshed"
    mine_too = student_edits(course / "my-labs/03_pipeline.updated.ipynb", "answer = 43")
    v4 = release(course, "03_pipeline.ipynb", "raise NotImplementedError('v4')")
    workspace(capsys)
    assert (course / "my-labs/03_pipeline.updated.ipynb").read_bytes() == mine_too
    assert (course / "my-labs/03_pipeline.updated-2.ipynb").read_bytes() == v4
    assert (course / "my-labs/03_pipeline.ipynb").read_bytes() == mine


@pytest.mark.parametrize("content", [b"not a notebook", b'{"cells": []}', b"[]"])
def test_a_copy_without_a_valid_stamp_is_never_replaced(course, capsys, content):
    (course / "my-labs").mkdir()
    (course / "my-labs/03_pipeline.ipynb").write_bytes(content)
    workspace(capsys)
    assert (course / "my-labs/03_pipeline.ipynb").read_bytes() == content
    assert (course / "my-labs/03_pipeline.updated.ipynb").exists()


def test_fresh_copy_goes_beside_the_students_and_never_over_anything(course, capsys):
    workspace(capsys)
    mine = student_edits(course / "my-labs/03_pipeline.ipynb", "answer = 42")
    code, out, _ = workspace(capsys, "--fresh", "03")
    assert code == 0 and out == ["wrote a fresh copy of 03_pipeline.ipynb: my-labs/03_pipeline.fresh.ipynb "
                                 "(your my-labs/03_pipeline.ipynb is unchanged)"]
    assert is_untouched(read_notebook(course / "my-labs/03_pipeline.fresh.ipynb"))
    again = workspace(capsys, "--fresh", "3")[1][0]
    assert again.endswith("is already a fresh copy of 03_pipeline.ipynb (nothing written)")
    fresh_work = student_edits(course / "my-labs/03_pipeline.fresh.ipynb", "answer = 0")
    assert workspace(capsys, "--fresh", "03_pipeline")[1][0].startswith(
        "wrote a fresh copy of 03_pipeline.ipynb: my-labs/03_pipeline.fresh-2.ipynb")
    assert (course / "my-labs/03_pipeline.ipynb").read_bytes() == mine
    assert (course / "my-labs/03_pipeline.fresh.ipynb").read_bytes() == fresh_work


@pytest.mark.parametrize("args, message", [
    (["--fresh", "09"], "error: --fresh 09: no such lab in labs/; the labs are 01_map, 03_pipeline"),
    (["--labs", "nope"], "error: --labs nope: no [0-9][0-9]_*.ipynb notebooks there"),
    (["--dir", "labs"], "error: --dir labs is the labs folder"),
])
def test_bad_arguments_are_one_line_errors(course, capsys, args, message):
    code, out, err = workspace(capsys, *args)
    assert code == 2 and err.startswith(message) and len(err.splitlines()) == 1
    assert not (course / "my-labs").exists()


def test_the_workspace_is_git_ignored_and_make_lab_opens_it():
    assert "my-labs/" in (ROOT / ".gitignore").read_text().splitlines()
    recipe = re.search(r"^lab:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "-m course_lib workspace --dir $(WORKSPACE)" in recipe and "root_dir=$(WORKSPACE)" in recipe


def test_no_lab_depends_on_the_folder_it_is_opened_from():
    """Labs are opened from my-labs/: no code cell may name a path relative to labs/ or the repo root."""
    relative = re.compile(r"""["'](?:\.\.?/|(?:figures|labs|solutions|tests|logs|course_lib)/)""")
    for lab in sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb")):
        for index, cell in enumerate(read_notebook(lab)["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] == "code":
                assert not relative.search(source), f"{lab.name} cell {index}: {relative.search(source).group(0)}"


def test_a_labs_pictures_travel_with_its_copy_in_the_workspace(tmp_path, capsys):
    """JupyterLab opened at my-labs/ serves nothing above it: each theory picture of a copied lab is a cell
    attachment of that copy (course_lib.classroom.notebooks.figures), never a ../ path."""
    assert main(["workspace", "--labs", str(ROOT / "labs"), "--dir", str(tmp_path / "my-labs")]) == 0
    shown = 0
    for copy in sorted((tmp_path / "my-labs").glob("[0-9][0-9]_*.ipynb")):
        for index, cell in enumerate(read_notebook(copy)["cells"]):
            if cell["cell_type"] != "markdown":
                continue
            for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", "".join(cell["source"])):
                assert target.startswith("attachment:"), f"{copy.name} cell {index}: {target}"
                assert target[len("attachment:"):] in cell.get("attachments", {}), f"{copy.name} cell {index}"
                shown += 1
    assert shown >= 6
