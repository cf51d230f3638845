"""Tiny helpers for writing a solution notebook from a Python build script (instructor tooling).

    from course_lib.nbbuild import md, code, write
    write("solutions/00_collectives.ipynb", [md("# Title"), code("print(1)")])

The notebook in ``solutions/`` is the single source of a lab; a build script is
a convenient way to write it, and ``make solutions`` executes it in place.
"""

import nbformat


def md(text: str):
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(text: str, tags=()):
    cell = nbformat.v4.new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def write(path: str, cells) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell["id"] = f"c{i:03d}"
    nbformat.write(nb, path)
