"""The solutions -> labs generator (course_lib.classroom.notebooks.generator) and the committed labs/.

The generator may replace a lab only when the lab's stamp proves it is what the
generator wrote; edited labs and notebooks no solution generates are kept, and
every refusal is one line that names the file (and the cell) and a step that
loses nothing.
"""

import base64
import json
import re
import subprocess
from pathlib import Path

import nbformat
import pytest

from course_lib.__main__ import main
from course_lib.classroom.notebooks.generator import make_lab, stub_source, survey
from course_lib.classroom.notebooks.stamp import is_untouched, read_notebook

ROOT = Path(__file__).resolve().parents[2]

SOURCE = """\
import torch

def f(x):
    ### BEGIN SOLUTION
    ### HINT: multiply by two
    y = x * 2
    return y
    ### END SOLUTION

print(f(1))
"""


def test_stub_replaces_the_block_keeps_indentation_and_uses_the_hint():
    stubbed, blocks = stub_source(SOURCE)
    assert blocks == 1
    assert stubbed == ("import torch\n\ndef f(x):\n    # YOUR CODE HERE\n"
                       "    raise NotImplementedError('multiply by two')\n\nprint(f(1))\n")
    namespace = {}
    exec(stubbed.replace("print(f(1))", ""), namespace)
    with pytest.raises(NotImplementedError, match="multiply by two"):
        namespace["f"](1)


def test_stub_without_hint_and_with_two_blocks():
    src = "### BEGIN SOLUTION\na = 1\n### END SOLUTION\nb = 2\n### BEGIN SOLUTION\nc = 3\n### END SOLUTION\n"
    stubbed, blocks = stub_source(src)
    assert blocks == 2 and "a = 1" not in stubbed and "c = 3" not in stubbed and "b = 2\n" in stubbed
    assert stubbed.count("raise NotImplementedError('replace this line with your solution')") == 2


@pytest.mark.parametrize("src, message", [
    ("### BEGIN SOLUTION\nx = 1\n", "without a matching ### END SOLUTION"),
    ("x = 1\n### END SOLUTION\n", "line 2: ### END SOLUTION without a matching"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n", "line 2: ### BEGIN SOLUTION inside another"),
])
def test_unbalanced_markers_are_reported_with_the_line(src, message):
    with pytest.raises(ValueError, match=message):
        stub_source(src)


def test_make_lab_clears_outputs_and_tags_only_exercise_cells():
    nb = nbformat.v4.new_notebook()
    plain = nbformat.v4.new_code_cell("print(1)")
    plain.outputs = [nbformat.v4.new_output("stream", text="1\n")]
    plain.execution_count = 3
    exercise = nbformat.v4.new_code_cell(SOURCE)
    nb.cells = [nbformat.v4.new_markdown_cell("# hi"), plain, exercise]
    lab = make_lab(nb)
    assert lab["cells"][1]["outputs"] == [] and lab["cells"][1]["execution_count"] is None
    assert "tags" not in lab["cells"][1]["metadata"]
    assert lab["cells"][2]["metadata"]["tags"] == ["exercise", "raises-exception"]
    assert nb.cells[1].outputs, "the solution notebook itself is left untouched"


def test_make_lab_drops_the_solution_runs_widget_state():
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {"x": {}}}}
    nb.metadata["kernelspec"] = {"name": "python3"}
    nb.cells = [nbformat.v4.new_code_cell("print(1)")]
    lab = make_lab(nb)
    assert "widgets" not in lab["metadata"] and lab["metadata"]["kernelspec"] == {"name": "python3"}
    assert "widgets" in nb.metadata, "the solution notebook itself is left untouched"


def test_committed_labs_are_generated_from_solutions_and_stamped():
    statuses, extras = survey(ROOT / "solutions", ROOT / "labs")
    not_current = [(s.path.name, s.state) for s in statuses if s.state != "current"]
    assert not not_current and not extras, f"labs/: {not_current}, no solution: {extras}: run `make labs`"
    assert all(is_untouched(read_notebook(s.path)) for s in statuses)


def test_every_lab_contains_no_solution_code():
    for lab in sorted((ROOT / "labs").glob("*.ipynb")):
        text = lab.read_text(encoding="utf-8")
        assert "### BEGIN SOLUTION" not in text and "### END SOLUTION" not in text, lab.name


# --- the command on a course in tmp_path ---------------------------------------------------------

EXERCISE = "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n"


def write_solution(course: Path, name: str, *cells) -> Path:
    """solutions/<name> made of ``cells`` (markdown for strings starting with '#', else code)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(c[2:]) if c.startswith("# ") else nbformat.v4.new_code_cell(c)
                for c in cells]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i:03d}"
    path = course / "solutions" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A course with two solutions and their generated labs; the working folder is the course."""
    write_solution(tmp_path, "01_a.ipynb", "# Lab A", EXERCISE)
    write_solution(tmp_path, "02_b.ipynb", "# Lab B", "print('b')")
    monkeypatch.chdir(tmp_path)
    assert main(["labs"]) == 0
    return tmp_path


def labs_snapshot(course):
    return {p.name: p.read_bytes() for p in sorted((course / "labs").iterdir())}


def fill_in_exercise(lab: Path) -> bytes:
    """What a student does in Jupyter: replace the stub with an answer, save."""
    nb = nbformat.read(lab, as_version=4)
    nb.cells[1].source = nb.cells[1].source.replace("raise NotImplementedError", "return x + x  #")
    nbformat.write(nb, lab)
    return lab.read_bytes()


def test_a_lab_the_generator_wrote_is_replaced_when_its_solution_changes(course, capsys):
    write_solution(course, "01_a.ipynb", "# Lab A, second edition", EXERCISE)
    assert main(["labs"]) == 0
    assert "second edition" in (course / "labs/01_a.ipynb").read_text()
    assert main(["labs", "--check"]) == 0


def test_an_edited_lab_is_never_overwritten(course, capsys):
    answer = fill_in_exercise(course / "labs/01_a.ipynb")
    write_solution(course, "01_a.ipynb", "# Lab A, second edition", EXERCISE)
    capsys.readouterr()
    assert main(["labs"]) == 1, "labs/ could not be brought up to date: say so with the exit code"
    assert (course / "labs/01_a.ipynb").read_bytes() == answer
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "labs/01_a.ipynb was edited by hand, so it is kept" in err[0]
    assert "mv -n" in err[0] and "my-labs/01_a.edited.ipynb" in err[0]


def test_notebooks_with_no_solution_are_never_deleted(course, capsys):
    (course / "labs/my notes.ipynb").write_text("{}")
    (course / "labs/02_b.ipynb").rename(course / "labs/07_old.ipynb")  # a generated lab whose solution is gone
    before = labs_snapshot(course)
    capsys.readouterr()
    assert main(["labs"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("labs/07_old.ipynb has no solution in solutions/, so it is kept")
    assert all((course / "labs" / name).read_bytes() == data for name, data in before.items())
    advice = err[1].split("`")[1]
    assert advice == "mkdir -p my-labs && mv -n 'labs/my notes.ipynb' 'my-labs/my notes.ipynb'"
    subprocess.run(advice, shell=True, check=True, cwd=course)
    assert (course / "my-labs/my notes.ipynb").read_text() == "{}"


@pytest.mark.parametrize("make_bad", [
    lambda c: "solutons",                                           # a typo
    lambda c: (c / "empty").mkdir() or "empty",                     # no notebooks
    lambda c: (c / "other").mkdir() or (c / "other/notes.ipynb").write_text("{}") and "other",  # no NN_*.ipynb
])
def test_a_wrong_solutions_folder_is_one_line_and_deletes_nothing(course, capsys, make_bad):
    bad = make_bad(course)
    before = labs_snapshot(course)
    capsys.readouterr()
    assert main(["labs", "--solutions", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --solutions {bad}:") and "nothing was changed" in err[0]
    assert labs_snapshot(course) == before


def test_labs_folder_equal_to_solutions_folder_is_refused(course, capsys):
    before = (course / "solutions/01_a.ipynb").read_bytes()
    assert main(["labs", "--labs", "solutions"]) == 2
    assert "is the --solutions folder" in capsys.readouterr().err
    assert (course / "solutions/01_a.ipynb").read_bytes() == before


def test_check_tells_a_lagging_lab_from_an_edited_one_and_its_advice_loses_nothing(course, capsys):
    write_solution(course, "01_a.ipynb", "# Lab A, second edition", EXERCISE)  # 01 lags
    lab_b = course / "labs/02_b.ipynb"
    nb = nbformat.read(lab_b, as_version=4)
    nb.cells[1].source = "print('my own answer')"
    nbformat.write(nb, lab_b)
    answer = lab_b.read_bytes()
    capsys.readouterr()
    assert main(["labs", "--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == ("labs/ lags solutions/ for 01_a.ipynb: run `make labs` "
                      "(safe: it never overwrites a notebook edited by hand)")
    assert len(err) == 2 and err[1].startswith("labs/02_b.ipynb was edited by hand")
    advice = err[1].split("`")[1]
    assert advice == "mkdir -p my-labs && mv -n labs/02_b.ipynb my-labs/02_b.edited.ipynb"
    subprocess.run(advice, shell=True, check=True, cwd=course)
    assert main(["labs"]) == 0 and main(["labs", "--check"]) == 0
    assert (course / "my-labs/02_b.edited.ipynb").read_bytes() == answer


def test_check_of_a_current_labs_folder_passes(course, capsys):
    assert main(["labs", "--check"]) == 0
    assert capsys.readouterr().out.strip() == "labs/ is up to date"


def test_generating_twice_writes_nothing_the_second_time(course, capsys):
    before = {p: p.stat().st_mtime_ns for p in (course / "labs").iterdir()}
    capsys.readouterr()
    assert main(["labs"]) == 0
    assert capsys.readouterr().out == ""
    assert {p: p.stat().st_mtime_ns for p in (course / "labs").iterdir()} == before


def _cells(*cells):
    return json.dumps({"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


@pytest.mark.parametrize("content, expected", [
    (b"{not json", "03_bad.ipynb: not valid JSON (line 1, column 2"),
    (b"[1, 2]", "03_bad.ipynb: a notebook is a JSON object with a 'cells' list, not a JSON list"),
    (b'{"metadata": {}}', "03_bad.ipynb: no 'cells' list"),
    (b'{"cells": {}}', "03_bad.ipynb: no 'cells' list"),
    (b"\xff\xfe{}", "03_bad.ipynb: not UTF-8 text"),
    (_cells({"cell_type": "code", "source": "x = 1", "metadata": {}},
            {"cell_type": "code", "source": 7, "metadata": {}}).encode(), "03_bad.ipynb: cell 1: 'source' is int 7"),
    (_cells({"cell_type": "code", "source": ["a", 3], "metadata": {}}).encode(),
     "03_bad.ipynb: cell 0: 'source' is list"),
    (_cells("print(1)").encode(), "03_bad.ipynb: cell 0 is a JSON str"),
    (_cells({"source": "x"}).encode(), "03_bad.ipynb: cell 0: 'cell_type' is None"),
])
def test_a_malformed_solution_is_one_line_naming_notebook_and_cell(course, capsys, content, expected):
    (course / "solutions/03_bad.ipynb").write_bytes(content)
    before = labs_snapshot(course)
    capsys.readouterr()
    assert main(["labs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: solutions/03_bad.ipynb") and expected in err[0], err
    assert labs_snapshot(course) == before, "nothing is written when any solution is malformed"


@pytest.mark.parametrize("cells, expected", [
    (("# Answer:\n### BEGIN SOLUTION\nthe secret\n### END SOLUTION",),
     "cell 0 (id c000): line 2: '### BEGIN SOLUTION' is a solution marker in a markdown cell"),
    (("x = 1\ny = 2  ### BEGIN SOLUTION\nsecret = 3\n### END SOLUTION",),
     "cell 0 (id c000): line 2: 'y = 2  ### BEGIN SOLUTION' looks like a solution marker"),
    (("print(0)", "### begin solution\nsecret = 3\n### end solution"),
     "cell 1 (id c001): line 1: '### begin solution' looks like a solution marker"),
    (("### BEGIN SOLUTION\nsecret = 3\n## End Solution\n### END SOLUTION",),
     "cell 0 (id c000): line 3: '## End Solution' looks like"),
])
def test_markers_that_would_leak_the_solution_are_refused(course, capsys, cells, expected):
    write_solution(course, "03_leak.ipynb", *cells)
    capsys.readouterr()
    assert main(["labs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: solutions/03_leak.ipynb: ") and expected in err[0], err
    assert not (course / "labs/03_leak.ipynb").exists()


# --- theory pictures: ../figures/NAME in solutions/, a cell attachment in labs/ -------------------

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d4944415478da63f8ffff3f0005fe02fea7d6a0b30000000049454e44ae426082")


def test_a_theory_figure_travels_in_the_lab_as_an_attachment(course):
    (course / "figures").mkdir()
    (course / "figures/ring.png").write_bytes(PNG)
    write_solution(course, "03_pic.ipynb", '# Ring\n\n![the ring](../figures/ring.png "a title") and again '
                                           '![same](../figures/ring.png), ![web](https://example.org/x.png)',
                   "print(1)")
    assert main(["labs"]) == 0
    cell = read_notebook(course / "labs/03_pic.ipynb")["cells"][0]
    assert "".join(cell["source"]) == ('Ring\n\n![the ring](attachment:ring.png "a title") and again '
                              '![same](attachment:ring.png), ![web](https://example.org/x.png)')
    assert list(cell["attachments"]) == ["ring.png"]
    assert base64.b64decode(cell["attachments"]["ring.png"]["image/png"]) == PNG
    assert "../figures" in "".join(read_notebook(course / "solutions/03_pic.ipynb")["cells"][0]["source"])
    assert main(["labs", "--check"]) == 0
    (course / "figures/ring.png").write_bytes(PNG + b"\0")  # a redrawn figure: the lab lags until regenerated
    assert main(["labs", "--check"]) == 1


@pytest.mark.parametrize("markdown, expected", [
    ("# T\n\n![x](../figures/gone.png)", "cell 0 (id c000): ../figures/gone.png: no such figure in"),
    ("# T\n\n![x](figures/a.png)", "cell 0 (id c000): image 'figures/a.png': a notebook's picture is a generated "
                                   "file of figures/"),
    ("# T\n\n![x](../figures/sub/a.png)", "image '../figures/sub/a.png'"),
    ("# T\n\n![x](../figures/notes.md)", "image '../figures/notes.md'"),
    ('# T\n\n<img src="../figures/a.png">', "<img src='../figures/a.png'>: write a local picture as markdown"),
])
def test_a_picture_no_reader_could_find_is_one_line_and_writes_nothing(course, capsys, markdown, expected):
    write_solution(course, "03_pic.ipynb", markdown)
    capsys.readouterr()
    assert main(["labs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: solutions/03_pic.ipynb: ") and expected in err[0], err
    assert not (course / "labs/03_pic.ipynb").exists()


def test_every_picture_of_the_course_is_a_generated_figure_and_resolves_in_its_lab():
    """Each ../figures/NAME a solution shows is a file `python -m course_lib figures` wrote (its ledger holds
    NAME with these very bytes), and the generated lab shows it from an attachment holding those bytes."""
    from course_lib.classroom.notebooks.figures import notebook_figures
    from course_lib.safe_files import OutputLedger

    ledger, shown = OutputLedger(ROOT / "figures"), {}
    for solution in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        names = notebook_figures(read_notebook(solution))
        shown[solution.stem] = names
        for name in names:
            data = (ROOT / "figures" / name).read_bytes()
            assert ledger.is_own(name), f"{solution.name}: figures/{name} is not what `course_lib figures` wrote"
            assert len(data) < 150_000, f"figures/{name}: {len(data)} bytes travel in every copy of the lab"
        lab = read_notebook(ROOT / "labs" / solution.name)
        images = [(cell, target) for cell in lab["cells"] if cell["cell_type"] == "markdown"
                  for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", "".join(cell["source"]))]
        assert [t for _, t in images if not t.startswith(("attachment:", "https:"))] == [], solution.name
        for cell, target in images:
            if target.startswith("attachment:"):
                name = target[len("attachment:"):]
                assert base64.b64decode(cell["attachments"][name]["image/png"]) == \
                    (ROOT / "figures" / name).read_bytes(), f"labs/{solution.name}: {name}"
    for stem in ("00_collectives", "01_topology", "02_tensor_parallel", "03_pipeline",
                 "04_sequence_context_parallel", "06_sizing_a_real_run"):
        assert shown.get(stem), f"{stem}: its theory shows no picture"
