"""An interactive pipeline explorer: p, m, v, schedule and t_b/t_f -> Gantt chart, bubble, memory.

Thin by design: :func:`explore` only calls the tested functions (``build_schedule``,
``check_schedule``, ``simulate``, the formulas, ``gantt``); :func:`pipeline_widget`
only wires sliders to it. Times: a forward takes 1 unit, a backward ``t_b/t_f``
units; zero-bubble schedules split that backward into equal B and W halves.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from course_lib.pipeline.bubbles import bubble_fraction, inflight_microbatches, pipeline_bubble_time
from course_lib.pipeline.check import check_schedule
from course_lib.pipeline.plots import gantt
from course_lib.pipeline.schedules import SCHEDULE_NAMES, build_schedule
from course_lib.pipeline.simulate import simulate


def explore(pp: int = 4, num_microbatches: int = 8, vp: int = 1, schedule: str = "1f1b",
            tb_over_tf: float = 2.0):
    """``(figure or None, text)`` for one setting; invalid settings give ``(None, "✗ <rule>")``."""
    notes = []
    if schedule != "interleaved" and vp > 1:
        notes.append(f"v={vp} only applies to the interleaved schedule: showing v=1")
        vp = 1
    if schedule == "interleaved" and vp == 1:
        notes.append("interleaved with v=1 is plain 1F1B (Megatron treats vp=1 as no interleaving)")
        schedule = "1f1b"
    try:
        s = build_schedule(schedule, pp, num_microbatches, vp)
        p2p = check_schedule(s)
    except ValueError as exc:
        return None, f"✗ {exc}"
    t_f, t_b, t_w = (1.0, tb_over_tf / 2, tb_over_tf / 2) if s.splits_backward else (1.0, tb_over_tf, 0.0)
    tl = simulate(s, t_f, t_b, t_w)
    m = num_microbatches
    lines = notes + [f"simulated bubble fraction {tl.bubble_fraction:.4f}  (idle / useful time, all ranks)"]
    if schedule in ("gpipe", "1f1b", "interleaved"):
        lines.append(f"formula (p-1)/(v m) = {bubble_fraction(pp, m, vp):.4f}")
    else:
        try:
            per_rank = pipeline_bubble_time(schedule, pp, t_f, t_b, t_w)
            lines.append(f"Qi et al. Table 2: {per_rank:.3g} time units idle per rank (inside its span); "
                         f"simulated {max(tl.span_bubble(r) for r in range(pp)):.3g}")
        except ValueError as exc:
            lines.append(f"Table 2 formula n/a: {exc}")
    peaks = [k / vp for k in tl.peak_activations]
    lines.append("peak live activations per rank (micro-batches of a whole stage): "
                 + ", ".join(f"{x:g}" for x in peaks))
    if schedule != "interleaved":
        lines.append(f"formula: {inflight_microbatches(pp, m, schedule)}")
    lines.append(f"point-to-point protocol that cannot deadlock: {p2p}")
    fig = gantt(tl, show_ids=m * vp <= 24)
    return fig, "\n".join(lines)


def pipeline_widget():
    """Sliders for p, m, v, the schedule and t_b/t_f; redraws the Gantt chart and figures on change."""
    import ipywidgets as W
    from IPython.display import display

    pp = W.IntSlider(value=4, min=1, max=8, description="p (stages)")
    m = W.IntSlider(value=8, min=1, max=32, description="m (micro-b.)")
    vp = W.IntSlider(value=1, min=1, max=4, description="v (chunks)")
    name = W.Dropdown(options=list(SCHEDULE_NAMES), value="1f1b", description="schedule")
    ratio = W.FloatSlider(value=2.0, min=0.5, max=4.0, step=0.25, description="t_b / t_f")
    out = W.Output()

    def redraw(*_):
        fig, text = explore(pp.value, m.value, vp.value, name.value, ratio.value)
        with out:
            out.clear_output(wait=True)
            if fig is not None:
                display(fig)
                plt.close(fig)
            print(text)

    for w in (pp, m, vp, name, ratio):
        w.observe(redraw, names="value")
    redraw()
    box = W.VBox([W.HBox([pp, m, vp]), W.HBox([name, ratio]), out])
    box.redraw = redraw
    return box
