"""The solutions -> labs generator (course_lib.labgen) and the committed labs/."""

from pathlib import Path

import nbformat
import pytest

from course_lib.labgen import make_lab, stale_labs, stub_source

ROOT = Path(__file__).resolve().parents[1]

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


def test_committed_labs_are_generated_from_solutions():
    stale = stale_labs(ROOT / "solutions", ROOT / "labs")
    assert not stale, f"labs/ is stale for {stale}: run `make labs`"


def test_every_lab_contains_no_solution_code():
    for lab in sorted((ROOT / "labs").glob("*.ipynb")):
        text = lab.read_text(encoding="utf-8")
        assert "### BEGIN SOLUTION" not in text and "### END SOLUTION" not in text, lab.name
