"""Build the website's files in memory: ``{path inside the site: bytes}``.

Each lab page is ``solutions/NN_topic.ipynb`` as :func:`reader.reader_notebook` gives
it (student stubs, outputs of non-exercise cells), its theory's ``../figures/NAME``
pictures copied to ``assets/figures/`` (:func:`course_lib.classroom.notebooks.figures.link_figures`),
plus :mod:`pictures` (widgets' default views), rendered by nbconvert's ``HTMLExporter`` with
:file:`page.html.j2` (JupyterLab's markup; no CDN). The index is a notebook of
markdown cells rendered the same way: the README's course map (linked to the pages,
with the total time) and glossary.

Before a page is kept, its text is searched for solution lines
(:func:`reader.leaked_lines`): a page that would show a solution stops the build.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from course_lib.classroom.notebooks.generator import solution_notebooks
from course_lib.classroom.notebooks.figures import link_figures
from course_lib.classroom.notebooks.stamp import read_notebook
from course_lib.classroom.site import pictures, readme
from course_lib.classroom.site.reader import leaked_lines, reader_notebook, solution_lines
from course_lib.rules import UsageError

HERE = Path(__file__).parent
PAGE_TEMPLATE = HERE / "page.html.j2"
ASSETS = "assets"


@dataclass(frozen=True)
class Lab:
    """One lab page: ``00_collectives`` -> ``00_collectives.html``."""

    source: Path
    title: str

    @property
    def stem(self) -> str:
        return self.source.stem

    @property
    def number(self) -> str:
        return self.stem[:2]

    @property
    def page(self) -> str:
        return f"{self.stem}.html"

    @property
    def label(self) -> str:
        """Short name for navigation: ``02 tensor parallel``."""
        return self.stem.replace("_", " ")


def notebook_title(notebook: dict, fallback: str) -> str:
    """The text of the notebook's first ``# heading`` (in a markdown cell), else ``fallback``."""
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        for line in ("".join(source) if isinstance(source, list) else source).splitlines():
            if line.startswith("# "):
                return line[2:].strip()
    return fallback


class _Text(HTMLParser):
    """The text of an HTML document (character references decoded), without scripts and styles."""

    def __init__(self):
        super().__init__()
        self.parts, self._skip = [], 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style") and self._skip > 0

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def html_text(document: str) -> str:
    """The text a page's HTML holds (line breaks of ``<pre>`` blocks kept)."""
    parser = _Text()
    parser.feed(document)
    return "".join(parser.parts)


class Renderer:
    """One nbconvert ``HTMLExporter`` for every page (building it is the slow part)."""

    def __init__(self, course: str):
        from nbconvert import HTMLExporter

        self.course = course
        self.exporter = HTMLExporter(template_name="lab", template_file=str(PAGE_TEMPLATE),
                                     exclude_anchor_links=True, theme="light")

    def jupyterlab_css(self) -> bytes:
        """JupyterLab's notebook CSS, as installed with nbconvert (one shared file instead of 250 kB a page)."""
        env = self.exporter.environment
        parts = [env.loader.get_source(env, f"static/{name}")[0] for name in ("index.css", "theme-light.css")]
        return "\n".join(parts).encode("utf-8")

    def page(self, notebook: dict, title: str, *, previous: Lab | None = None, following: Lab | None = None,
             notice: str = "") -> str:
        """The HTML of one page."""
        import nbformat

        metadata = {**notebook.get("metadata", {}), "title": f"{title} · {self.course}"}
        node = nbformat.reads(json.dumps({**notebook, "metadata": metadata}), as_version=4)  # joins line lists
        site = {"assets": ASSETS, "course": self.course, "notice": notice,
                "previous": previous and {"href": previous.page, "label": previous.label},
                "next": following and {"href": following.page, "label": following.label},
                "footer": "Built with <code>make site</code> (<code>python -m course_lib site</code>) from the "
                          "tested notebooks in <code>solutions/</code>. Every file is local: the pages work "
                          "offline, from <code>file://</code> or any static host."}
        body, _ = self.exporter.from_notebook_node(node, resources={"site": site})
        return body


def _markdown_notebook(*texts: str) -> dict:
    cells = [{"cell_type": "markdown", "id": f"index-{i}", "metadata": {}, "source": text}
             for i, text in enumerate(texts)]
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def course_map_markdown(table: readme.Table, labs: list[Lab], where: str) -> str:
    """The README's course map with each row's notebook linked to its page, and the total time."""
    lab_col, time_col = table.column("lab", where), table.column("time", where)
    notebook_col = table.column("notebook", where)
    pages = {lab.stem: lab for lab in labs}
    rows = []
    for row in table.rows:
        stem = readme.notebook_stem(row[notebook_col]) if notebook_col < len(row) else None
        cells = list(row)
        if stem in pages:
            cells[lab_col] = f"[{cells[lab_col]}]({pages[stem].page})"
            cells[notebook_col] = f"[read it]({pages[stem].page}) · run `labs/{stem}.ipynb`"
        rows.append(cells)
    header = list(table.header)
    header[notebook_col] = "page"
    text = readme.Table(header, rows).markdown()
    times = [readme.hours(row[time_col]) for row in table.rows if time_col < len(row)]
    if times and None not in times:
        text += f"\n\nTotal: **{sum(times):g} h** of lab time (the `time` column)."
    listed = {readme.notebook_stem(row[notebook_col]) for row in table.rows if notebook_col < len(row)}
    unlisted = [lab for lab in labs if lab.stem not in listed]
    if unlisted:
        text += "\n\nNot yet in the README's course map: " + ", ".join(
            f"[{lab.title}]({lab.page})" for lab in unlisted) + "."
    return text


def index_notebook(readme_text: str, labs: list[Lab], where: str = "README.md") -> dict:
    """The index page as a notebook of markdown cells, from the README's title and tables."""
    course_map = readme.section_table(readme_text, "Course map", where)
    glossary = readme.section_table(readme_text, "Glossary", where)
    intro = (f"# {readme.title(readme_text, where)}\n\n"
             "Every lab as a page you can read before running anything: the theory, the pictures, the code and "
             "its outputs. Exercise cells show what you will fill in, never the solution. To run the labs: "
             "`make lab` (see the README).")
    return _markdown_notebook(intro, f"## {course_map.heading}\n\n" + course_map_markdown(course_map, labs, where),
                              f"## {glossary.heading}\n\n" + glossary.markdown())


def lab_notice(lab: Lab) -> str:
    """The line above a lab page: what it is, and how to run the lab."""
    stem = html.escape(lab.stem)
    return (f"A read-only page built from <code>solutions/{stem}.ipynb</code> with its stored outputs. "
            f"Exercise cells show the stub you fill in (their outputs are left out). To run the lab: "
            f"<code>make lab</code>, then open <code>my-labs/{stem}.ipynb</code>.")


def find_labs(solutions_dir: Path, only: list[str] | None = None) -> list[tuple[Lab, dict]]:
    """The labs to build, with their solution notebooks; ``only`` keeps those numbered ``NN`` (or named)."""
    found = []
    for path in solution_notebooks(solutions_dir):
        if only and path.stem[:2] not in only and path.stem not in only:
            continue
        notebook = read_notebook(path)
        found.append((Lab(path, notebook_title(notebook, path.stem)), notebook))
    if only and not found:
        raise UsageError(f"--labs {' '.join(only)}: no such lab in {solutions_dir}")
    return found


def lab_page_files(lab: Lab, solution: dict, figures_dir: Path, renderer: Renderer, *,
                   previous: Lab | None, following: Lab | None) -> dict[str, bytes]:
    """The page of one lab and the pictures it adds; ``ValueError`` if the page would show a solution line."""
    try:
        notebook = reader_notebook(solution)
        secret = solution_lines(solution)
    except ValueError as exc:
        raise UsageError(f"{lab.source}: {exc}") from None
    files = pictures.replace_widget_outputs(notebook, lab.stem)  # first: picture names use the notebook's cell numbers
    try:
        shown = link_figures(notebook, figures_dir, pictures.FIGURE_FOLDER)  # the theory's own ../figures/NAME
    except ValueError as exc:
        raise UsageError(f"{lab.source}: {exc}") from None
    files.update(shown)
    page = renderer.page(notebook, lab.title, previous=previous, following=following, notice=lab_notice(lab))
    leaked = leaked_lines(html_text(page), secret)
    if leaked:
        raise UsageError(f"{lab.page} would show solution code from {lab.source} ({leaked[0]!r}); nothing was written")
    files[lab.page] = page.encode("utf-8")
    return files


def build_site(solutions_dir: Path, figures_dir: Path, readme_path: Path,
               only: list[str] | None = None) -> dict[str, bytes]:
    """Every file of the site, ``{relative path: bytes}`` (nothing is written here)."""
    try:
        readme_text = Path(readme_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--readme {readme_path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not Path(figures_dir).is_dir():
        raise UsageError(f"--figures {figures_dir}: no such folder (the committed figures/; 'make figures' redraws it)")
    labs = find_labs(Path(solutions_dir), only)
    renderer = Renderer(readme.title(readme_text, str(readme_path)))
    files = {f"{ASSETS}/jupyterlab.css": renderer.jupyterlab_css(),
             f"{ASSETS}/site.css": (HERE / "site.css").read_bytes()}
    order = [lab for lab, _ in labs]
    for i, (lab, solution) in enumerate(labs):
        files.update(lab_page_files(lab, solution, Path(figures_dir), renderer,
                                    previous=order[i - 1] if i else None,
                                    following=order[i + 1] if i + 1 < len(order) else None))
    index = renderer.page(index_notebook(readme_text, order, str(readme_path)), "Course map",
                          following=order[0] if order else None)
    files["index.html"] = index.encode("utf-8")
    return files
