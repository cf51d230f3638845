"""The pipeline pictures build from the tested functions (no display needed); the explorer widget: tests/classroom/test_widgets.py."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.pipeline.plots import bubble_vs_microbatches, gantt, gantt_compare, memory_bars  # noqa: E402
from course_lib.pipeline.schedules import build_schedule  # noqa: E402
from course_lib.pipeline.simulate import simulate  # noqa: E402


def test_gantt_draws_one_box_per_action_with_ids():
    tl = simulate(build_schedule("interleaved", 2, 4, 2))
    fig = gantt(tl)
    ax = fig.axes[0]
    assert len(ax.patches) == sum(len(a) for a in tl.schedule.ranks)
    assert sorted({t.get_text() for t in ax.texts}) == ["0", "1", "2", "3"]
    assert "bubble fraction 0.125" in ax.get_title()
    plt.close(fig)


def test_compare_bubble_and_memory_figures():
    s = build_schedule("zb-h1", 3, 6)
    a, b = simulate(s, 1, 1, 1), simulate(s, 1, 1, 1, p2p_latency=0.1)
    for fig in (gantt_compare(a, b), bubble_vs_microbatches(microbatches=range(1, 9)),
                memory_bars([simulate(build_schedule("1f1b", 3, 6)), a])):
        assert isinstance(fig, matplotlib.figure.Figure)
        plt.close(fig)


def test_cli_prints_orders_and_bubble(capsys):
    import argparse

    from course_lib.pipeline import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--schedule", "1f1b", "--pp", "2", "--microbatches", "3", "--orders"])) == 0
    out = capsys.readouterr().out
    assert "rank 0 | F0 F1 B0 F2 B1 B2" in out and "bubble fraction=0.3333" in out and "batched" in out
    with pytest.raises(ValueError, match="must be 0 or >= pp_size"):
        cli.run(parser.parse_args(["--schedule", "interleaved", "--vp", "2", "--microbatches", "6"]))
