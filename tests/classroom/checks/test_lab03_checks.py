"""Lab 03's checkers: for each exercise a table of wrong answers (each with the hint it must get) and
right answers written differently (any real type, Actions, other valid orders), which must pass."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from course_lib.classroom.checks import pipeline_bubbles, pipeline_schedules
from course_lib.pipeline.schedules import Action


def todo(*args):
    raise NotImplementedError("write it")


def test_not_attempted(capsys):
    for check in (pipeline_schedules.check_warmup, pipeline_schedules.check_order, pipeline_bubbles.check_bubble,
                  pipeline_schedules.check_peak_memory, pipeline_schedules.check_orders_on_ranks):
        assert check(todo).ok is False
        assert capsys.readouterr().out.startswith("not attempted yet")


def _table(check, table, capsys):
    for fn, passes, words in table:
        assert check(fn).ok is passes, words
        out = capsys.readouterr().out
        for word in words:
            assert word in out, out


def test_warmup_table(capsys):
    _table(pipeline_schedules.check_warmup, [
        (lambda p, m, r: min(p - r - 1, m), True, ["✓"]),
        (lambda p, m, r: np.int64(min(p - r - 1, m)), True, ["✓"]),
        (lambda p, m, r: float(min(p - r - 1, m)), True, ["✓"]),
        (lambda p, m, r: p - r - 1, False, ["cap it at m"]),
        (lambda p, m, r: min(p - r, m), False, ["one forward too many"]),
        (lambda p, m, r: min(r, m), False, ["count the stages after rank r"]),
        (lambda p, m, r: (p - r - 1) / 2, False, ["whole number"]),
        (lambda p, m, r: None, False, ["returned None"]),
    ], capsys)


def one_f_one_b(p, m, r, warmup=None, backward_first=False):
    w = min(p - r - 1, m) if warmup is None else max(0, min(warmup, m))
    order = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        order += [f"B{i}", f"F{w + i}"] if backward_first else [f"F{w + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - w, m)]


def test_order_table(capsys):
    _table(pipeline_schedules.check_order, [
        (one_f_one_b, True, ["✓"]),
        (lambda p, m, r: tuple(Action(a[0], int(a[1:])) for a in one_f_one_b(p, m, r)), True, ["✓"]),
        # one warm-up forward too many equals GPipe on 2 stages: it must still be named for what it is
        (lambda p, m, r: one_f_one_b(p, m, r, warmup=p - r), False,
         ["order_1f1b(3, 4, 0)", "one forward too long"]),
        (lambda p, m, r: one_f_one_b(p, m, r, warmup=p - r - 2), False, ["one forward too short"]),
        (lambda p, m, r: [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)], False, ["that is GPipe"]),
        (lambda p, m, r: one_f_one_b(p, m, r, backward_first=True), False, ["*then* one backward"]),
        (lambda p, m, r: one_f_one_b(p, m, r, warmup=p - 1), False, ["every rank warms up with p - 1"]),
        (lambda p, m, r: one_f_one_b(p, m, r)[:-1], False, ["exactly one F and one B"]),
        (lambda p, m, r: one_f_one_b(p, m, r)[::-1], False, ["the schedule checker says", "hint"]),
        (lambda p, m, r: "F0 B0", False, ["list of strings like 'F0'"]),
    ], capsys)


def test_bubble_table(capsys):
    _table(pipeline_bubbles.check_bubble, [
        (lambda p, m, v: (p - 1) / (v * m), True, ["✓"]),
        (lambda p, m, v: Fraction(p - 1, v * m), True, ["✓"]),
        (lambda p, m, v: torch.tensor((p - 1) / (v * m), dtype=torch.float64), True, ["✓"]),
        (lambda p, m, v: np.float32((p - 1) / (v * m)), True, ["✓"]),
        (lambda p, m, v: float("nan"), False, ["NaN"]),
        (lambda p, m, v: float("inf"), False, ["infinite"]),
        (lambda p, m, v: str((p - 1) / (v * m)), False, ["string"]),
        (lambda p, m, v: (p - 1) / (v * m + p - 1), False, ["share of the *whole* iteration"]),
        (lambda p, m, v: (p - 1) / m, False, ["v times shorter"]),
        (lambda p, m, v: (p - 1) // (v * m), False, ["integer division"]),
        (lambda p, m, v: 1 / 0, False, ["raised ZeroDivisionError"]),
    ], capsys)


def _peaks(p, m, name):
    return {"gpipe": [m] * p, "1f1b": [min(p - r, m) for r in range(p)], "zb-h1": [min(p, m)] * p}[name]


def test_peak_memory_table(capsys):
    _table(pipeline_schedules.check_peak_memory, [
        (_peaks, True, ["✓"]),
        (lambda p, m, name: np.array(_peaks(p, m, name)), True, ["✓"]),
        (lambda p, m, name: tuple(float(x) for x in _peaks(p, m, name)), True, ["✓"]),
        (lambda p, m, name: [min(p - r - 1, m) for r in range(p)] if name == "1f1b" else _peaks(p, m, name), False,
         ["off by one"]),
        (lambda p, m, name: [m] * p, False, ["that is GPipe"]),
        (lambda p, m, name: _peaks(p, m, "1f1b") if name == "zb-h1" else _peaks(p, m, name), False,
         ["ZB-H1"]),
        (lambda p, m, name: "4 3 2 1", False, ["one whole number per rank"]),
    ], capsys)


MEGATRON_P3_M4 = [one_f_one_b(3, 4, r) for r in range(3)]
RANKS_TABLE = [
    # (orders, passes, words): fast answers first; each deadlock costs the timeout
    (MEGATRON_P3_M4, True, ["✓", "exactly Megatron's 1F1B order"]),
    (lambda: MEGATRON_P3_M4, True, ["✓"]),
    (one_f_one_b, True, ["✓"]),  # the student's order_1f1b(p, m, r) runs too
    ([tuple(Action(a[0], int(a[1:])) for a in order) for order in MEGATRON_P3_M4], True, ["✓"]),
    ([["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], one_f_one_b(3, 4, 1), one_f_one_b(3, 4, 2)], False,
     ["idle more than 1F1B", "simulated bubble 1.000"]),  # a warm-up too short runs, but idles
    ([[f"F{i}" for i in range(4)] + [f"B{i}" for i in range(4)]] * 3, False, ["held 4", "that is GPipe's memory"]),
    ([one_f_one_b(3, 4, r, warmup=3 - r) for r in range(3)], False, ["rank 0 held 4", "after p - r - 1 warm-up"]),
    ([one_f_one_b(3, 4, 2)] * 3, False, ["idle more than 1F1B", "serialises the pipeline"]),
    ([one_f_one_b(3, 4, 0), one_f_one_b(3, 4, 1), one_f_one_b(3, 4, 2)[:-1]], False,
     ["cannot run", "rank 2 never runs B of micro-batch 3"]),
    ([one_f_one_b(3, 5, r) for r in range(3)], False, ["micro-batch 4 does not exist"]),
    (MEGATRON_P3_M4[:2], False, ["give 3 lists"]),
    ([one_f_one_b(3, 4, 2), one_f_one_b(3, 4, 1), one_f_one_b(3, 4, 2)], False,
     ["a deadlock", "first blocked message: the schedule cannot run", "rank 0 waits at B0 for the grad of micro-batch 0"]),
]


@pytest.mark.parametrize("orders, passes, words", RANKS_TABLE, ids=[str(i) for i in range(len(RANKS_TABLE))])
def test_orders_on_real_ranks_table(orders, passes, words, capsys):
    assert pipeline_schedules.check_orders_on_ranks(orders, timeout=4).ok is passes
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


def test_a_table_of_the_fixed_settings_fails_on_the_drawn_ones(capsys):
    """Warm-ups and bubbles looked up for the fixed settings fail on the pipelines drawn per run; the line
    names the call, not the answer."""
    from course_lib.pipeline.schedules import num_warmup_microbatches

    table = {(p, m, r): num_warmup_microbatches(p, m, r) for p, m in pipeline_schedules.SETTINGS for r in range(p)}
    assert pipeline_schedules.check_warmup(lambda p, m, r: table.get((p, m, r), 0)).ok is False
    out = capsys.readouterr().out
    assert "✗ warmup_1f1b(" in out and "expected" not in out, out
    bubbles = {(p, m, v): (p - 1) / (v * m) for p in (1, 2, 4, 8) for m in (1, 4, 8, 16) for v in (1, 2)}
    assert pipeline_bubbles.check_bubble(lambda p, m, v: bubbles.get((p, m, v), 0.0)).ok is False
    assert "✗ bubble(" in capsys.readouterr().out
