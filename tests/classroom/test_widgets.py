"""The labs' widgets (course_lib.classroom.widgets): thin ipywidgets over the library's pure, tested
functions -- the rank map, the pipeline explorer, the sizing explorer. No display needed."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.classroom.widgets.pipeline import explore, pipeline_widget  # noqa: E402
from course_lib.sizing import PRESETS, plan  # noqa: E402

TINY = PRESETS["tiny GPT (seed)"]["model"]


# ---- the rank map ------------------------------------------------------------------------------

def test_widget_render_and_controls():
    from course_lib.classroom.widgets.topology import RankMapWidget, render

    out = render(8, tp=2, pp=2, highlight=5)
    assert out["error"] is None and "<svg" in out["svg"]
    assert "<b>[4, 5]</b>" in out["table"] and "<b>[5, 7]</b>" in out["table"]
    assert render(8, tp=3, pp=1)["error"].startswith("world_size=8 is not divisible")
    w = RankMapWidget(world_size=8, tp=2, pp=2, engine="matplotlib")
    assert "tp=2, pp=2, cp=1, dp=2" in w.status.value
    w.controls["cp"].value = 2
    assert "dp=1" in w.status.value and "<svg" in w.picture.value
    w.controls["world_size"].value = 12  # tp 2 x pp 2 x cp 2 does not divide 12: one red line
    assert "is not divisible" in w.status.value and w.picture.value == ""
    w.controls["cp"].value = 3
    assert "world_size=12, tp=2, pp=2, cp=3, dp=1" in w.status.value


def test_widget_expert_view_appears_only_with_ep():
    from course_lib.classroom.widgets.topology import RankMapWidget, expert_view, render

    assert expert_view(8, tp=2, pp=2) is None and render(8, tp=2, pp=2)["experts"] is None  # EP 1: today's view
    ex = expert_view(8, tp=2, pp=1, ep=2, num_experts=4)
    assert "<svg" in ex["svg"] and "<td>[0, 2]</td>" in ex["table"] and (ex["grid"].ep, ex["grid"].expert_dp) == (2, 2)
    assert "num-experts" in render(8, tp=1, pp=1, ep=4, num_experts=6)["error"]
    w = RankMapWidget(world_size=8, tp=2, pp=1, engine="matplotlib")
    assert w.experts.value == ""
    w.controls["num_experts"].value = 4
    w.controls["ep"].value = 2
    assert "Expert grid" in w.experts.value and "<td>[0, 2]</td>" in w.experts.value
    w.controls["expert_tp"].value = 1
    assert "<td>[0, 1]</td>" in w.experts.value
    w.controls["ep"].value = 8  # expert tp 1 x ep 8 fits 8 ranks, but 4 experts do not split 8 ways
    assert w.experts.value == "" and "num-experts" in w.status.value


# ---- the pipeline explorer --------------------------------------------------------------------

def test_explore_reports_formula_and_simulation():
    fig, text = explore(4, 8, 2, "interleaved", 2.0)
    assert "simulated bubble fraction 0.1875" in text and "(p-1)/(v m) = 0.1875" in text
    assert "peak live activations per rank (micro-batches of a whole stage): 5.5, 4.5, 3.5, 2.5" in text
    plt.close(fig)
    fig, text = explore(4, 8, 1, "zb-h1", 2.0)
    assert "Table 2: 3 time units idle per rank" in text and "simulated 3" in text
    plt.close(fig)
    fig, text = explore(4, 6, 2, "interleaved")
    assert fig is None and text.startswith("✗ num_microbatches=6 % microbatch_group_size_per_vp_stage")


def test_widget_builds_and_redraws():
    pytest.importorskip("ipywidgets")
    box = pipeline_widget()
    box.children[0].children[0].value = 2  # p: triggers a redraw
    box.redraw()
    plt.close("all")


# ---- the sizing explorer ----------------------------------------------------------------------

def test_widget_pieces():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.classroom.widgets.sizing import describe, memory_figure

    assert describe(TINY, tp=3).startswith("invalid configuration: num_attention_heads=8 is not divisible")
    p = plan(TINY, **PRESETS["tiny GPT (seed)"]["config"])
    fig = memory_figure(p)
    ax = fig.axes[0]
    assert len(ax.patches) == 4 * 2  # four parts stacked on each of the two stages
    plt.close(fig)


def test_explorer_widget_updates_and_explains():
    pytest.importorskip("ipywidgets")
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.classroom.widgets.sizing import explorer

    box = explorer("tiny GPT (seed)")
    text = box.children[-2]  # the summary; the figure goes to the Output widget below it
    assert "tiny GPT (seed)" in text.value and "fits on a 80 GB GPU: yes" in text.value
    tp_box = box.children[1].children[0]
    tp_box.value = 3
    assert "invalid configuration" in text.value and "num_attention_heads=8 is not divisible" in text.value
    box.children[0].children[0].value = "GPT-3 175B"  # a new preset loads its configuration
    assert "GPT-3 175B" in text.value and "TP=8 PP=8 DP=16" in text.value
    box.children[2].children[3].value = "full"  # recompute
    assert "recompute=full" in text.value
    with pytest.raises(ValueError, match="preset='nope'"):
        explorer("nope")
