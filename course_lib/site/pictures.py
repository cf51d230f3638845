"""The pictures a lab page adds to its notebook: figures beside the theory, and each widget's default view.

* :data:`THEORY_FIGURES`: for a lab whose notebook shows no ``../figures/NAME`` picture of
  its own (see :mod:`course_lib.notebook_figures`), which files of ``figures/`` (drawn by
  ``python -m course_lib figures`` from the tested drawing functions) go after which
  markdown cell. A figure goes after the first markdown cell containing its anchor
  text; when a notebook no longer has that text, after the lab's introduction, with
  a warning, so an edited heading never breaks the build.
* :func:`widget_view`: a widget cannot run on a static page, so its output is replaced
  by a picture of the view the widget opens with, drawn by the same tested function
  the widget calls (``topology.widget.render``, ``pipeline.widget.explore``,
  ``sizing.widget.memory_figure``), with the call's own arguments.
"""

from __future__ import annotations

import ast
import html
import inspect
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

FIGURE_FOLDER = "assets/figures"
WIDGET_FOLDER = "assets/widgets"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@dataclass(frozen=True)
class TheoryFigure:
    """One file of ``figures/`` shown after the markdown cell that contains ``anchor``."""

    anchor: str
    name: str
    caption: str


# lab number -> its figures, in page order. Only for a lab whose theory shows no picture of its own: a
# notebook that writes ![caption](../figures/NAME) (course_lib.notebook_figures) gets exactly those.
THEORY_FIGURES: dict[str, list[TheoryFigure]] = {
    "05": [TheoryFigure("MAP", "rankmap_8_tp2_pp2_dp2.svg", "Config D: TP=2 × PP=2 × DP=2 on 8 ranks"),
           TheoryFigure("MAP", "rankmap_8_tp2_pp2_cp2.svg", "Config F: TP=2 × PP=2 × CP=2 on 8 ranks")],
}


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def figure_html(src: str, caption: str, alt: str | None = None) -> str:
    """A ``<figure>`` with an image and its caption (escaped)."""
    return (f'<figure class="course-figure"><img src="{html.escape(src)}" alt="{html.escape(alt or caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _markdown_cell(cell_id: str, text: str) -> dict:
    return {"cell_type": "markdown", "id": cell_id, "metadata": {"tags": ["course-site-figure"]}, "source": text}


def add_theory_figures(notebook: dict, lab_number: str, figures_dir: Path, warn=None) -> dict[str, bytes]:
    """Insert the lab's :data:`THEORY_FIGURES` into ``notebook`` (in place); return ``{site path: bytes}``.

    A missing file is a one-line ``ValueError`` (``figures/`` is committed: ``make figures``
    redraws it); a missing anchor puts the figure after the first markdown cell and calls
    ``warn(message)`` (default: print to stderr).
    """
    warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
    files, cells = {}, notebook["cells"]
    # inserted last to first, so that figures sharing an anchor keep their order
    for number, figure in reversed(list(enumerate(THEORY_FIGURES.get(lab_number, [])))):
        path = figures_dir / figure.name
        if not path.is_file():
            raise ValueError(f"{path}: no such figure; run 'make figures' (python -m course_lib figures) to draw it")
        site_path = f"{FIGURE_FOLDER}/{figure.name}"
        files[site_path] = path.read_bytes()
        markdown = [i for i, cell in enumerate(cells) if cell.get("cell_type") == "markdown"]
        anchored = [i for i in markdown if figure.anchor in _source(cells[i])]
        if not anchored:
            warn(f"lab {lab_number}: no markdown cell mentions {figure.anchor!r}; {figure.name} goes after the "
                 f"introduction (update THEORY_FIGURES in {Path(__file__).name})")
        after = anchored[0] if anchored else (markdown[0] if markdown else -1)
        cells.insert(after + 1, _markdown_cell(f"course-figure-{number}", figure_html(site_path, figure.caption)))
    return files


# ----------------------------------------------------------------------------------------
# Widgets: the default view as a static picture
# ----------------------------------------------------------------------------------------

@dataclass
class WidgetView:
    """What replaces a widget's output: files to write and the HTML that shows them."""

    files: dict[str, bytes] = field(default_factory=dict)
    html: str = ""


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _note(what: str) -> str:
    return (f'<p class="widget-note">Static picture of the widget\'s default view ({html.escape(what)}). '
            f"Run the lab in JupyterLab (<code>make lab</code>) to move its controls.</p>")


def _rank_map_view(stem: str, args, kwargs) -> WidgetView:
    from course_lib.topology.widget import RankMapWidget, render

    call = inspect.signature(RankMapWidget).bind(*args, **kwargs)
    call.apply_defaults()
    out = render(**call.arguments)
    if out["error"]:
        raise ValueError(f"the RankMapWidget call shows an error on start: {out['error']}")
    name = f"{WIDGET_FOLDER}/{stem}-rank-map.svg"
    caption = f"Rank map widget on start: {out['grid']!r}"
    return WidgetView({name: out["svg"].encode("utf-8")},
                      _note("topology.widget.render") + figure_html(name, caption) + out["table"])


def _pipeline_view(stem: str, args, kwargs) -> WidgetView:
    from course_lib.pipeline.widget import explore

    if args or kwargs:
        raise ValueError("pipeline_widget() takes no arguments; its view starts at explore()'s defaults")
    fig, text = explore()  # pipeline_widget's sliders start at explore()'s defaults
    name = f"{WIDGET_FOLDER}/{stem}-pipeline.png"
    defaults = ", ".join(f"{k}={p.default!r}" for k, p in inspect.signature(explore).parameters.items())
    return WidgetView({name: _png(fig)}, _note("pipeline.widget.explore") +
                      figure_html(name, f"Pipeline explorer on start: explore({defaults})") +
                      f"<pre>{html.escape(text)}</pre>")


def _sizing_view(stem: str, args, kwargs) -> WidgetView:
    from course_lib.sizing.planner import PRESETS, plan, summary
    from course_lib.sizing.widget import explorer, memory_figure

    call = inspect.signature(explorer).bind(*args, **kwargs)
    call.apply_defaults()
    preset = PRESETS[call.arguments["preset"]]  # the explorer loads every control from the preset
    p = plan(preset["model"], **preset["config"])
    name = f"{WIDGET_FOLDER}/{stem}-sizing.png"
    return WidgetView({name: _png(memory_figure(p))}, _note("sizing.widget.memory_figure") +
                      figure_html(name, f"Sizing explorer on start: {call.arguments['preset']}") +
                      f"<pre>{html.escape(summary(p))}</pre>")


# the function a notebook cell calls -> how to draw its default view
WIDGET_VIEWS = {"RankMapWidget": _rank_map_view, "pipeline_widget": _pipeline_view, "explorer": _sizing_view}


def _widget_call(source: str):
    """``(name, args, kwargs)`` of the cell's last expression when it calls a known widget, else None."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    last = body[-1] if body else None
    if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Name)
            and last.value.func.id in WIDGET_VIEWS):
        return None
    call = last.value
    try:
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except ValueError:  # a variable among the arguments: not a view we can draw without running the notebook
        return None
    return call.func.id, args, kwargs


def widget_view(source: str, stem: str) -> WidgetView:
    """The static replacement for the widget that the code cell ``source`` displays.

    ``stem`` names the picture files (one widget per cell). A widget this module does not
    know gets a note instead of a picture (and the page test then misses its picture).
    """
    found = _widget_call(source)
    if found is None:
        return WidgetView(html='<p class="widget-note">An interactive widget: run the lab in JupyterLab '
                               "(<code>make lab</code>) to see it.</p>")
    name, args, kwargs = found
    return WIDGET_VIEWS[name](stem, args, kwargs)


def replace_widget_outputs(notebook: dict, lab_stem: str) -> dict[str, bytes]:
    """Replace every widget output of ``notebook`` (in place) by its static view; return the files to write."""
    files = {}
    for index, cell in enumerate(notebook["cells"]):
        outputs = cell.get("outputs", [])
        if not any(WIDGET_MIME in out.get("data", {}) for out in outputs):
            continue
        view = widget_view(_source(cell), f"{lab_stem}-cell{index}")
        files.update(view.files)
        kept = [out for out in outputs if WIDGET_MIME not in out.get("data", {})]
        cell["outputs"] = kept + [{"output_type": "display_data", "metadata": {},
                                   "data": {"text/html": view.html}}]
    return files
