"""The pictures a lab page adds to its notebook: each widget's default view.

(A lab's theory pictures are its own ``![caption](../figures/NAME)`` lines, copied by
:func:`course_lib.classroom.notebooks.figures.link_figures`.)

* :func:`widget_view`: a widget cannot run on a static page, so its output is replaced
  by a picture of the view the widget opens with, drawn by the same tested function
  the widget calls (``widgets.topology.render``, ``widgets.pipeline.explore``,
  ``widgets.sizing.memory_figure``), with the call's own arguments.
"""

from __future__ import annotations

import ast
import html
import inspect
import io
from dataclasses import dataclass, field
from course_lib.rules import UsageError

FIGURE_FOLDER = "assets/figures"
WIDGET_FOLDER = "assets/widgets"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def figure_html(src: str, caption: str, alt: str | None = None) -> str:
    """A ``<figure>`` with an image and its caption (escaped)."""
    return (f'<figure class="course-figure"><img src="{html.escape(src)}" alt="{html.escape(alt or caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


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
    from course_lib.classroom.widgets.topology import RankMapWidget, render

    call = inspect.signature(RankMapWidget).bind(*args, **kwargs)
    call.apply_defaults()
    out = render(**call.arguments)
    if out["error"]:
        raise UsageError(f"the RankMapWidget call shows an error on start: {out['error']}")
    name = f"{WIDGET_FOLDER}/{stem}-rank-map.svg"
    caption = f"Rank map widget on start: {out['grid']!r}"
    return WidgetView({name: out["svg"].encode("utf-8")},
                      _note("widgets.topology.render") + figure_html(name, caption) + out["table"])


def _pipeline_view(stem: str, args, kwargs) -> WidgetView:
    from course_lib.classroom.widgets.pipeline import explore

    if args or kwargs:
        raise UsageError("pipeline_widget() takes no arguments; its view starts at explore()'s defaults")
    fig, text = explore()  # pipeline_widget's sliders start at explore()'s defaults
    name = f"{WIDGET_FOLDER}/{stem}-pipeline.png"
    defaults = ", ".join(f"{k}={p.default!r}" for k, p in inspect.signature(explore).parameters.items())
    return WidgetView({name: _png(fig)}, _note("widgets.pipeline.explore") +
                      figure_html(name, f"Pipeline explorer on start: explore({defaults})") +
                      f"<pre>{html.escape(text)}</pre>")


def _sizing_view(stem: str, args, kwargs) -> WidgetView:
    from course_lib.sizing.planner import PRESETS, plan, summary
    from course_lib.classroom.widgets.sizing import explorer, memory_figure

    call = inspect.signature(explorer).bind(*args, **kwargs)
    call.apply_defaults()
    preset = PRESETS[call.arguments["preset"]]  # the explorer loads every control from the preset
    p = plan(preset["model"], **preset["config"])
    name = f"{WIDGET_FOLDER}/{stem}-sizing.png"
    return WidgetView({name: _png(memory_figure(p))}, _note("widgets.sizing.memory_figure") +
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
