"""Bubble formulas: published values, and agreement with the simulated schedules."""

import subprocess
import sys

import pytest

from course_lib.pipeline.bubbles import (bubble_fraction, bubble_share, inflight_microbatches,
                                         pipeline_bubble_time)
from course_lib.pipeline.schedules import build_schedule
from course_lib.pipeline.simulate import simulate


def test_published_values():
    # Narayanan et al. 2021, Sec. 2.2: (p-1)/m, interleaved (p-1)/(v m).
    assert bubble_fraction(4, 8) == 3 / 8 and bubble_fraction(4, 8, vp=2) == 3 / 16
    # The seed's review question 5: PP=2 vs PP=4 at 8 micro-batches.
    assert (bubble_fraction(2, 8), bubble_fraction(4, 8)) == (0.125, 0.375)
    assert (bubble_share(2, 8), bubble_share(4, 8)) == pytest.approx((1 / 9, 3 / 11))
    # Huang et al. 2019 (GPipe): the bubble is negligible once M >= 4K -- under 20% of the time.
    assert all(bubble_share(k, 4 * k) < 0.2 for k in range(1, 65))
    # Qi et al. 2023, Table 2 / Fig. 3 with T_F = T_B = T_W = 1: 1F1B 3(p-1), ZB-H1 a third of it, ZB-H2 zero.
    p = 4
    assert pipeline_bubble_time("1f1b", p, 1, 1, 1) == 9
    assert pipeline_bubble_time("zb-h1", p, 1, 1, 1) == 3
    assert pipeline_bubble_time("zb-h2", p, 1, 1, 1) == 0


def test_1f1b_and_gpipe_formula_equals_simulation_for_any_times():
    for name in ("1f1b", "gpipe"):
        for p in (1, 2, 4, 8):
            for m in (1, 3, 8):
                for tf, tb, tw in ((1, 2, 0), (1, 1, 1), (2, 3, 1.5)):
                    tl = simulate(build_schedule(name, p, m), tf, tb, tw)
                    assert tl.bubble_time == pytest.approx(pipeline_bubble_time(name, p, tf, tb, tw), abs=1e-12)
                    assert tl.bubble_fraction == pytest.approx(bubble_fraction(p, m), abs=1e-12)


@pytest.mark.parametrize("name, min_m", [("zb-h1", lambda p: p), ("zb-h2", lambda p: 2 * p - 1)])
def test_zero_bubble_table_2_equals_simulation(name, min_m):
    """Table 2 holds when t_w <= t_f and m is large enough; the bubble is the one inside each rank's span."""
    checked = 0
    for p in (2, 3, 4, 8):
        for m in (min_m(p), min_m(p) + 1, 2 * min_m(p), 24):
            for tf, tb, tw in ((1, 1, 1), (1, 2, 1), (1, 1, 0.5), (2, 2, 1), (3, 1, 1), (1, 2, 0.5), (2, 1, 1)):
                tl = simulate(build_schedule(name, p, m), tf, tb, tw)
                span = max(tl.span_bubble(r) for r in range(p))
                assert span == pytest.approx(pipeline_bubble_time(name, p, tf, tb, tw), abs=1e-9), (p, m, tf, tb, tw)
                checked += 1
    assert checked == 4 * 4 * 7


def test_zero_bubble_h1_is_a_third_of_1f1b_with_equal_times():
    for p in (2, 4, 8):
        one = simulate(build_schedule("1f1b", p, 2 * p), 1, 1, 1)
        zb = simulate(build_schedule("zb-h1", p, 2 * p), 1, 1, 1)
        assert zb.bubble_time * 3 == one.bubble_time
        assert max(zb.peak_activations) == max(one.peak_activations) == p


def test_inflight_microbatches_equal_simulated_peaks():
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 13):
            for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
                tl = simulate(build_schedule(name, p, m))
                assert tl.peak_activations == inflight_microbatches(p, m, name), (name, p, m)
            for vp in (2, 3):
                for group in range(p, m + 1):
                    try:
                        s = build_schedule("interleaved", p, m, vp, group)
                    except ValueError:
                        continue
                    got = inflight_microbatches(p, m, "interleaved", vp=vp, microbatch_group_size=group)
                    assert simulate(s).peak_activations == got, (p, m, vp, group)
    assert inflight_microbatches(4, 8, "1f1b") == [4, 3, 2, 1]


@pytest.mark.parametrize("call, rule", [
    (lambda: bubble_fraction(0, 8), "pp=0"),
    (lambda: bubble_fraction(4, 0), "num_microbatches=0"),
    (lambda: bubble_fraction(4, 8, vp=0), "vp=0"),
    (lambda: bubble_fraction(4, 8.0), "must be an integer"),
    (lambda: pipeline_bubble_time("dualpipe", 4, 1, 1, 1), "unknown"),
    (lambda: pipeline_bubble_time("1f1b", 4, -1, 1, 1), "t_f=-1"),
    (lambda: pipeline_bubble_time("zb-h1", 4, 1, 1, 2), "t_w <= t_f"),
    (lambda: inflight_microbatches(4, 8, "zb-v"), "unknown"),
    (lambda: inflight_microbatches(4, 6, "interleaved", vp=2), "microbatch_group_size"),
])
def test_bad_input_is_one_line_value_error(call, rule):
    with pytest.raises(ValueError, match=rule) as err:
        call()
    assert "\n" not in str(err.value)


def test_pure_modules_do_not_import_torch():
    code = ("import sys; import course_lib.pipeline.bubbles, course_lib.pipeline.schedules, "
            "course_lib.pipeline.simulate, course_lib.pipeline.check; "
            "import course_lib.pipeline as P; P.bubble_fraction(2, 2); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
