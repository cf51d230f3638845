"""course_lib.classroom.notebooks.nbval_plugin: in one ``pytest --nbval`` session, labs/ is compared laxly and solutions/ strictly."""

import subprocess
import sys

import nbformat


def _notebook(path, checked_output):
    stale = nbformat.v4.new_code_cell("print(2)", execution_count=1)
    stale.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]  # not what it prints
    marked = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(3)", execution_count=2)
    marked.outputs = [nbformat.v4.new_output("stream", name="stdout", text=checked_output)]
    nb = nbformat.v4.new_notebook()
    nb.cells = [stale, marked]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def test_labs_cells_are_lax_solutions_cells_strict_in_one_session(tmp_path):
    _notebook(tmp_path / "labs" / "good.ipynb", "3\n")
    _notebook(tmp_path / "labs" / "marked_wrong.ipynb", "4\n")   # NBVAL_CHECK_OUTPUT is still compared
    _notebook(tmp_path / "solutions" / "strict.ipynb", "3\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "course_lib.classroom.notebooks.nbval_plugin", "labs", "solutions",
                           "--nbval", "-q", "-p", "no:cacheprovider", "-rf"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    failed = sorted(line[len("FAILED "):].split(" - ")[0] for line in done.stdout.splitlines()
                    if line.startswith("FAILED"))
    assert failed == ["labs/marked_wrong.ipynb::Cell 1", "solutions/strict.ipynb::Cell 0"], done.stdout
    assert "2 failed, 4 passed" in done.stdout
