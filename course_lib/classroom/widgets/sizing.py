"""Sizing explorer: pick a model and a TP/PP/DP/CP/SP/recompute/ZeRO layout, see what a rank holds.

A thin layer over :func:`course_lib.sizing.planner.plan` (pure, tested): every number shown comes
from the paper formulas in :mod:`course_lib.sizing`. An impossible layout is explained (the
one-line ValueError of :func:`~course_lib.sizing.planner.validate_config`) instead of plotted.

Usage in a notebook::

    from course_lib.classroom.widgets.sizing import explorer
    explorer()                      # starts on the GPT-3 175B preset

:func:`memory_figure` and :func:`describe` are the pieces the widget draws with; they work
without ipywidgets (e.g. in tests and static notebook cells).
"""

from __future__ import annotations

from course_lib.sizing.planner import GB, PRESETS, Plan, plan, summary
from course_lib.rules import UsageError

PARTS = ("weights", "grads", "optimizer", "activations")
COLORS = {"weights": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}
CONFIG_KEYS = ("tp", "pp", "dp", "cp", "vp", "sequence_parallel", "recompute", "zero_stage",
               "micro_batch_size", "global_batch_size")


def describe(model, **config) -> str:
    """The explorer's text for one layout: :func:`~course_lib.sizing.planner.summary`, or why it is invalid."""
    try:
        return summary(plan(model, **config))
    except ValueError as exc:
        return f"invalid configuration: {exc}"


def memory_figure(p: Plan):
    """Stacked bars of per-rank memory (GB = 1e9 bytes), one bar per pipeline stage.

    Weights, gradients, optimizer states and activations of one rank of each stage (the first
    stage only for the interleaved schedule), with the GPU's capacity as a dashed line. Returns
    the matplotlib Figure; the caller shows it.
    """
    import matplotlib.pyplot as plt

    stages = p.stage_memory if p.stage_memory is not None else [p.memory]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    xs = range(len(stages))
    bottom = [0.0] * len(stages)
    for part in PARTS:
        values = [st[part] / GB for st in stages]
        ax.bar(xs, values, bottom=bottom, color=COLORS[part], label=part, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    cap = p.gpu_memory_bytes / GB
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(-0.5, cap, f" {cap:.0f} GB GPU", va="bottom", ha="left", fontsize=8)
    ax.set_xlabel("pipeline stage (one rank of it)" if p.stage_memory is not None else "first stage")
    if len(stages) > 16:
        ax.set_xticks([0, len(stages) - 1])
    else:
        ax.set_xticks(list(xs))
    ax.set_ylabel("GB per rank")
    ax.set_ylim(0, max(cap, max(bottom)) * 1.15)
    c = p.config
    verdict = "fits" if p.fits else "does NOT fit"
    ax.set_title(f"{p.model.name}: TP{c['tp']} PP{c['pp']} DP{c['dp']} CP{c['cp']}, "
                 f"recompute={c['recompute']}, ZeRO-{c['zero_stage']} -> {verdict}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right", ncol=4)
    fig.tight_layout()
    return fig


def explorer(preset: str = "GPT-3 175B"):
    """An ipywidgets panel: model preset x layout -> memory bars, bubble, communication, fit."""
    import html

    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    if preset not in PRESETS:
        raise UsageError(f"preset={preset!r} is not one of: {', '.join(PRESETS)}")
    ints = {k: w.BoundedIntText(description=k, min=1, max=100000, layout=w.Layout(width="170px"))
            for k in ("tp", "pp", "dp", "cp", "vp", "micro_batch_size", "global_batch_size")}
    ints["micro_batch_size"].description = "micro batch"
    ints["global_batch_size"].description = "global batch"
    sp = w.Checkbox(description="sequence parallel")
    recompute = w.Dropdown(options=["none", "selective", "full"], description="recompute")
    zero = w.Dropdown(options=[0, 1, 2, 3], description="ZeRO stage")
    gpu = w.FloatText(value=80.0, description="GPU GB", layout=w.Layout(width="170px"))
    choose = w.Dropdown(options=list(PRESETS), value=preset, description="model")
    text = w.HTML()  # the summary, or why the layout is invalid
    out = w.Output()  # the memory bars
    controls = {**ints, "sequence_parallel": sp, "recompute": recompute, "zero_stage": zero}
    state = {"loading": False}

    def redraw(*_):
        if state["loading"]:
            return
        model = PRESETS[choose.value]["model"]
        config = {k: controls[k].value for k in CONFIG_KEYS}
        out.clear_output(wait=True)
        try:
            p = plan(model, gpu_memory_gb=gpu.value, **config)
        except ValueError as exc:
            text.value = f"<pre><b>invalid configuration:</b> {html.escape(str(exc))}</pre>"
            return
        text.value = f"<pre>{html.escape(summary(p))}</pre>"
        fig = memory_figure(p)
        with out:
            display(fig)
        plt.close(fig)

    def load(*_):
        state["loading"] = True
        for key, value in PRESETS[choose.value]["config"].items():
            controls[key].value = value
        state["loading"] = False
        redraw()

    for widget in (*controls.values(), gpu):
        widget.observe(redraw, names="value")
    choose.observe(load, names="value")
    load()
    rows = [w.HBox([choose, gpu]),
            w.HBox([ints["tp"], ints["pp"], ints["dp"], ints["cp"], ints["vp"]]),
            w.HBox([ints["micro_batch_size"], ints["global_batch_size"], sp, recompute, zero]),
            text, out]
    return w.VBox(rows)
