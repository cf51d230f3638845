"""An interactive rank map: sliders and menus -> the map and the group table.

A thin layer over tested functions: ``render(...)`` (pure: sizes in, SVG text and
an HTML table out, or a one-line error) is what the widget calls on every change.

    from course_lib.classroom.widgets.topology import RankMapWidget
    RankMapWidget(world_size=8, tp=2, pp=2)   # in a notebook cell
"""

from __future__ import annotations

import html
import io

from course_lib.rules import divisors
from course_lib.topology.config import ParallelConfig
from course_lib.topology.grid import DEFAULT_ORDER, MEGATRON_GROUPS, RankGrid

ORDERS = [
    ("tp-cp-ep-dp-pp  (Megatron default)", "tp-cp-ep-dp-pp"),
    ("tp-cp-ep-pp-dp  (pp before dp)", "tp-cp-ep-pp-dp"),
    ("tp-pp-dp  (Megatron's documented alternative)", "tp-pp-dp-cp"),
    ("tp-cp-pp-dp  (picotron's view(dp, pp, cp, tp))", "tp-cp-pp-dp"),
    ("dp-pp-cp-tp  (TP slowest: a bad idea)", "dp-pp-cp-tp"),
]


def group_table_html(grid: RankGrid, highlight: int | None = None) -> str:
    """The main groups as an HTML table; the highlighted rank's group in bold."""
    rows = []
    for token in grid.main_tokens():
        groups = grid.groups(token)
        shown = []
        for g in groups[:32]:
            txt = "[" + ", ".join(map(str, g)) + "]"
            shown.append(f"<b>{txt}</b>" if highlight is not None and highlight in g else txt)
        more = f" … ({len(groups) - 32} more)" if len(groups) > 32 else ""
        what = html.escape(MEGATRON_GROUPS.get(token, ("", ""))[1])
        rows.append(f"<tr><td><code>{token}</code></td><td>{len(groups)} × {len(groups[0])}</td>"
                    f"<td>{' '.join(shown)}{more}</td><td>{what}</td></tr>")
    head = "<tr><th>group</th><th>count × size</th><th>ranks</th><th>what runs in it</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def expert_view(world_size: int, tp: int, pp: int, cp: int = 1, order: str = DEFAULT_ORDER, ep: int = 1,
                expert_tp: int | None = None, num_experts: int = 8) -> dict | None:
    """The expert grid (Lab 08) for a layout: ``None`` when ``ep == 1`` and ``expert_tp`` is ``None`` or
    ``tp`` (the dense view is the whole story), else ``{'grid': RankGrid, 'table': HTML of who holds which
    experts and which ranks each all-to-all runs in, 'svg': the two-grids rank map}``. Bad sizes raise
    the one-line ValueError of :class:`course_lib.topology.RankGrid` / ``rules.moe_experts``."""
    if ep == 1 and expert_tp in (None, tp):
        return None
    from course_lib.moe.plots import expert_placement_html, plot_two_grids

    grid = RankGrid(world_size, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=expert_tp, order=order)
    return {"grid": grid, "table": expert_placement_html(grid, num_experts), "svg": _svg(plot_two_grids(grid))}


def _svg(fig) -> str:
    """A matplotlib figure as SVG text (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def render(world_size: int, tp: int, pp: int, cp: int = 1, order: str = DEFAULT_ORDER,
           highlight: int | None = None, engine: str = "graphviz", ep: int = 1, expert_tp: int | None = None,
           num_experts: int = 8) -> dict:
    """``{'svg': map as SVG text, 'table': HTML table, 'grid': RankGrid, 'experts': expert view or None,
    'error': None}`` for a layout (``experts`` from :func:`expert_view`: None for EP = 1); for an invalid
    one ``{'error': the ValueError's one line}`` and None elsewhere."""
    try:
        grid = ParallelConfig(world_size, tp=tp, pp=pp, cp=cp, order=order).grid
        if highlight is not None:
            grid.coords(highlight)
        experts = expert_view(world_size, tp, pp, cp, order, ep, expert_tp, num_experts)
    except ValueError as exc:
        return {"svg": None, "table": None, "grid": None, "experts": None, "error": str(exc)}
    from course_lib.topology.rankmap import rank_map, rank_map_figure

    svg = None
    if engine == "graphviz":
        try:
            svg = rank_map(grid, highlight=highlight).pipe(format="svg").decode()
        except Exception:  # noqa: BLE001 - no `dot` binary: fall back to matplotlib
            svg = None
    if svg is None:
        svg = _svg(rank_map_figure(grid, highlight=highlight))
    return {"svg": svg, "table": group_table_html(grid, highlight), "grid": grid, "experts": experts,
            "error": None}


class RankMapWidget:
    """World size, tp, pp, cp, order and a rank to highlight -> the map and the table; ep, expert tp and
    num experts -> the expert view below them (shown only when ep > 1 or expert tp != tp).

    ``.ui`` is the ipywidgets box (displayed when the object is the cell's value);
    ``.controls`` maps names to the control widgets; ``.update()`` redraws.
    """

    def __init__(self, world_size: int = 8, tp: int = 2, pp: int = 2, cp: int = 1, order: str = DEFAULT_ORDER,
                 highlight: int | None = None, engine: str = "graphviz", ep: int = 1,
                 expert_tp: int | None = None, num_experts: int = 8):
        import ipywidgets as W

        self.engine = engine
        self._busy = False
        style = {"description_width": "90px"}
        self.controls = {
            "world_size": W.IntSlider(value=world_size, min=1, max=128, description="world size", style=style,
                                      continuous_update=False),
            "tp": W.Dropdown(options=divisors(world_size), value=tp, description="tp", style=style),
            "pp": W.Dropdown(options=divisors(world_size), value=pp, description="pp", style=style),
            "cp": W.Dropdown(options=divisors(world_size), value=cp, description="cp", style=style),
            "order": W.Dropdown(options=ORDERS if order in dict(ORDERS).values() else ORDERS + [(order, order)],
                                value=order, description="order", style=style),
            "highlight": W.IntSlider(value=-1 if highlight is None else highlight, min=-1, max=world_size - 1,
                                     description="highlight", style=style, continuous_update=False),
            "ep": W.Dropdown(options=divisors(world_size), value=ep, description="ep", style=style),
            "expert_tp": W.Dropdown(options=[("= tp", None)] + [(str(d), d) for d in divisors(world_size)],
                                    value=expert_tp, description="expert tp", style=style),
            "num_experts": W.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128], value=num_experts,
                                      description="num experts", style=style),
        }
        self.picture = W.HTML()
        self.table = W.HTML()
        self.status = W.HTML()
        self.experts = W.HTML()
        c = self.controls
        self.ui = W.VBox([W.HBox([c["world_size"], c["highlight"]]), W.HBox([c["tp"], c["pp"], c["cp"]]),
                          W.HBox([c["ep"], c["expert_tp"], c["num_experts"]]),
                          c["order"], self.status, self.picture, self.table, self.experts])
        c["world_size"].observe(self._world_changed, names="value")
        for name in ("tp", "pp", "cp", "order", "highlight", "ep", "expert_tp", "num_experts"):
            c[name].observe(lambda _change: None if self._busy else self.update(), names="value")
        self.update()

    def _world_changed(self, change):
        n = change["new"]
        self._busy = True  # one redraw at the end, not one per control
        try:
            for name in ("tp", "pp", "cp", "ep"):
                dd = self.controls[name]
                keep = dd.value if n % dd.value == 0 else 1
                dd.options = divisors(n)
                dd.value = keep
            etp = self.controls["expert_tp"]
            keep = etp.value if etp.value is None or n % etp.value == 0 else None
            etp.options = [("= tp", None)] + [(str(d), d) for d in divisors(n)]
            etp.value = keep
            hl = self.controls["highlight"]
            hl.value = min(hl.value, n - 1)
            hl.max = n - 1
        finally:
            self._busy = False
        self.update()

    def values(self) -> dict:
        c = self.controls
        hl = c["highlight"].value
        return dict(world_size=c["world_size"].value, tp=c["tp"].value, pp=c["pp"].value, cp=c["cp"].value,
                    order=c["order"].value, highlight=None if hl < 0 else hl, ep=c["ep"].value,
                    expert_tp=c["expert_tp"].value, num_experts=c["num_experts"].value)

    def update(self) -> None:
        """Redraw the map and the table from the controls' values."""
        out = render(**self.values(), engine=self.engine)
        if out["error"]:
            self.status.value = f'<span style="color:#d62728">{html.escape(out["error"])}</span>'
            self.picture.value, self.table.value, self.experts.value = "", "", ""
        else:
            self.status.value = f"<code>{html.escape(repr(out['grid']))}</code>"
            self.picture.value, self.table.value = out["svg"], out["table"]
            ex = out["experts"]
            self.experts.value = "" if ex is None else f"<h4>Expert grid</h4>{ex['svg']}{ex['table']}"

    def _ipython_display_(self):
        from IPython.display import display

        display(self.ui)
