"""Lab 03's checkers: right answers pass, typical wrong answers get the specific hint, stubs are 'not attempted'."""

from course_lib.checks import lab03
from course_lib.pipeline.schedules import schedule_gpipe


def todo(*args):
    raise NotImplementedError("write it")


def test_not_attempted(capsys):
    for check in (lab03.check_warmup, lab03.check_order, lab03.check_bubble, lab03.check_peak_memory):
        assert check(todo) is False
        assert capsys.readouterr().out.startswith("not attempted yet")


def test_warmup(capsys):
    assert lab03.check_warmup(lambda p, m, r: min(p - r - 1, m))
    assert lab03.check_warmup(lambda p, m, r: p - r - 1) is False
    assert "cap it at m" in capsys.readouterr().out
    assert lab03.check_warmup(lambda p, m, r: min(r, m)) is False
    assert "count the stages after rank r" in capsys.readouterr().out


def test_order(capsys):
    def one_f_one_b(p, m, r):
        w = min(p - r - 1, m)
        order = [f"F{i}" for i in range(w)]
        for i in range(m - w):
            order += [f"F{w + i}", f"B{i}"]
        return order + [f"B{i}" for i in range(m - w, m)]

    assert lab03.check_order(one_f_one_b)
    assert "✓" in capsys.readouterr().out
    assert lab03.check_order(lambda p, m, r: [str(a) for a in schedule_gpipe(p, m, r)]) is False
    assert "that is GPipe" in capsys.readouterr().out
    assert lab03.check_order(lambda p, m, r: one_f_one_b(p, m, r)[::-1]) is False
    assert "hint" in capsys.readouterr().out


def test_bubble(capsys):
    assert lab03.check_bubble(lambda p, m, v: (p - 1) / (v * m))
    assert lab03.check_bubble(lambda p, m, v: (p - 1) / (v * m + p - 1)) is False
    assert "share of the *whole* iteration" in capsys.readouterr().out
    assert lab03.check_bubble(lambda p, m, v: (p - 1) / m) is False
    assert "v times shorter" in capsys.readouterr().out


def test_peak_memory(capsys):
    def right(p, m, name):
        return {"gpipe": [m] * p, "1f1b": [min(p - r, m) for r in range(p)], "zb-h1": [min(p, m)] * p}[name]

    assert lab03.check_peak_memory(right)
    assert lab03.check_peak_memory(lambda p, m, name: [min(p - r - 1, m) for r in range(p)]
                                   if name == "1f1b" else right(p, m, name)) is False
    assert "off by one" in capsys.readouterr().out
