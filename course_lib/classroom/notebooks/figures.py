"""Pictures in a notebook's theory: ``![caption](../figures/NAME.png)`` in ``solutions/``, resolved for each reader.

A lab's theory needs its pictures *before* anything runs (on GitHub, in a fresh
``my-labs/`` copy, on the website). The pictures are the generated files of
``figures/`` (``python -m course_lib figures``), so a markdown cell of
``solutions/NN_topic.ipynb`` refers to one as ``../figures/NAME`` -- the path that
resolves from ``solutions/`` in JupyterLab opened at the repository root. Every
other reader gets the picture without ``../``:

* :func:`embed_figures` (``labgen``, for ``labs/``): the reference becomes
  ``attachment:NAME`` and the bytes go into the cell's ``attachments`` (base64,
  nbformat 4's cell attachments), so the lab carries its pictures wherever it is
  copied: ``my-labs/`` (JupyterLab serves nothing above its root), GitHub, VS Code.
* :func:`link_figures` (the website): the reference becomes ``assets/figures/NAME``
  and the file is copied there.

Only markdown image syntax is read (``![alt](target)``, an optional ``"title"``);
a relative image anywhere else (``figures/x.png``, ``<img src="x.png">``) would
break in one of the readers, so it is refused, as is a name that is not a plain
file name of ``figures/``. Absolute URLs, ``data:`` and ``attachment:`` targets are
left alone.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from course_lib.rules import UsageError

FIGURES_PREFIX = "../figures/"
MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
        ".svg": "image/svg+xml"}
# ![alt](target "title")  -- the target has no spaces (markdown's rule without <...>)
_IMAGE = re.compile(r'!\[(?P<alt>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+"[^"]*")?\)')
_HTML_IMG = re.compile(r"""<img\b[^>]*\bsrc\s*=\s*["']?(?P<target>[^"'\s>]+)""", re.I)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
_LEFT_ALONE = re.compile(r"(?i)^(?:[a-z][a-z0-9+.-]*:|/|#)")  # http:, data:, attachment:, /abs, #anchor


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _where(index: int, cell: dict) -> str:
    cell_id = cell.get("id")
    return f"cell {index}" + (f" (id {cell_id})" if isinstance(cell_id, str) else "")


def figure_name(target: str) -> str | None:
    """``NAME`` for a target ``../figures/NAME`` (a plain file name with an image suffix), else None.

    Raises a one-line ``ValueError`` for a relative image that no reader but one would find."""
    if _LEFT_ALONE.match(target):
        return None
    name = target[len(FIGURES_PREFIX):] if target.startswith(FIGURES_PREFIX) else None
    if name is None or not _NAME.fullmatch(name) or Path(name).suffix.lower() not in MIME:
        raise UsageError(f"image {target!r}: a notebook's picture is a generated file of figures/, written "
                         f"{FIGURES_PREFIX}NAME with NAME one of its {'/'.join(sorted(MIME))} files "
                         f"(other relative paths do not resolve in labs/, my-labs/ or the website)")
    return name


def figure_refs(source: str) -> list[str]:
    """The ``figures/`` names a markdown source shows, in order (``ValueError`` for a misplaced image)."""
    for found in _HTML_IMG.finditer(source):
        if not _LEFT_ALONE.match(found.group("target")):
            raise UsageError(f"<img src={found.group('target')!r}>: write a local picture as markdown, "
                             f"![caption]({FIGURES_PREFIX}NAME), so every reader can resolve it")
    names = [figure_name(found.group("target")) for found in _IMAGE.finditer(source)]
    return [name for name in names if name]


def notebook_figures(notebook: dict) -> list[str]:
    """Every ``figures/`` name the notebook's markdown cells show, in order, without repeats."""
    names = []
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") == "markdown":
            try:
                names += figure_refs(_source(cell))
            except ValueError as exc:
                raise UsageError(f"{_where(index, cell)}: {exc}") from None
    return list(dict.fromkeys(names))


def _rewrite(notebook: dict, figures_dir: Path, new_target) -> dict[str, bytes]:
    """Point every figure reference at ``new_target(name, cell, data)``; return ``{name: bytes}`` of the files.

    A missing file is a one-line ``ValueError`` naming the cell (callers work on a copy,
    so a half-rewritten notebook is never kept)."""
    read: dict[str, bytes] = {}
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "markdown":
            continue
        source = _source(cell)
        try:
            names = figure_refs(source)
        except ValueError as exc:
            raise UsageError(f"{_where(index, cell)}: {exc}") from None
        for name in (n for n in names if n not in read):
            path = Path(figures_dir) / name
            if not path.is_file():
                raise UsageError(f"{_where(index, cell)}: {FIGURES_PREFIX}{name}: no such figure in {figures_dir}; "
                                 f"draw it with `make figures` (python -m course_lib figures) or correct the name")
            read[name] = path.read_bytes()

        def replace(found, cell=cell):
            name = figure_name(found.group("target"))
            if name is None:
                return found.group(0)
            return f"![{found.group('alt')}]({new_target(name, cell, read[name])}{found.group('title') or ''})"

        if names:
            cell["source"] = _IMAGE.sub(replace, source)
    return read


def embed_figures(notebook: dict, figures_dir: Path) -> list[str]:
    """Turn every ``../figures/NAME`` of ``notebook`` (in place) into a cell attachment; return the names.

    ``figures_dir`` is the folder ``../figures`` means for this notebook."""
    def attach(name, cell, data):
        mime = MIME[Path(name).suffix.lower()]
        cell.setdefault("attachments", {})[name] = {mime: base64.b64encode(data).decode("ascii")}
        return f"attachment:{name}"

    return list(_rewrite(notebook, figures_dir, attach))


def link_figures(notebook: dict, figures_dir: Path, folder: str) -> dict[str, bytes]:
    """Point every ``../figures/NAME`` of ``notebook`` (in place) at ``folder/NAME``; return ``{folder/NAME: bytes}``."""
    read = _rewrite(notebook, figures_dir, lambda name, cell, data: f"{folder}/{name}")
    return {f"{folder}/{name}": data for name, data in read.items()}
