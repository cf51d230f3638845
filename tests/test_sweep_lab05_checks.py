"""Lab 05's checkers: right answers pass, typical mistakes get their specific hint, stubs are "not attempted"."""

import pytest

from course_lib.checks import lab05 as L
from course_lib.megatron import SEED_SWEEP


def _todo(*args):
    raise NotImplementedError


# ---------------------------------------------------------------- exercise 1: DP and micro-batches

def layout(world, tp, pp, cp, micro, gbs):
    if world % (tp * pp * cp):
        raise ValueError("world_size % (tp*pp*cp) != 0")
    dp = world // (tp * pp * cp)
    if gbs % (micro * dp):
        raise ValueError("global % (micro*dp) != 0")
    return dp, gbs // (micro * dp)


def layout_no_cp(world, tp, pp, cp, micro, gbs):
    dp = world // (tp * pp)
    return dp, gbs // (micro * dp)


def layout_no_dp(world, tp, pp, cp, micro, gbs):
    return world // (tp * pp * cp), gbs // micro


def layout_floats(world, tp, pp, cp, micro, gbs):
    dp, m = layout(world, tp, pp, cp, micro, gbs)
    return float(dp), float(m)


def layout_never_raises(world, tp, pp, cp, micro, gbs):
    dp = max(1, world // (tp * pp * cp))
    return dp, gbs // (micro * dp)


@pytest.mark.parametrize("fn, ok, text", [
    (layout, True, "✓ derive_layout"),
    (layout_no_cp, False, "CP ranks are not data-parallel replicas"),
    (layout_no_dp, False, "m = global / (micro * DP)"),
    (layout_floats, False, "return Python ints"),
    (layout_never_raises, False, "Megatron refuses it: raise ValueError"),
    (_todo, False, "not attempted yet: write derive_layout"),
])
def test_check_layout(fn, ok, text, capsys):
    assert L.check_layout(fn) is ok
    assert text in capsys.readouterr().out


def test_layout_cases_agree_with_the_seed():
    # the seed's own arithmetic: TP2 PP2 -> DP2; TP4 PP2 -> DP1; TP2 PP2 CP2 -> DP1 (8 GPUs)
    assert L._want(8, 2, 2, 1, 1, 16)[0] == 2 and L._want(8, 4, 2, 1, 1, 16)[0] == 1
    assert L._want(8, 2, 2, 2, 1, 16) == (1, 16)
    assert [L._want(8, *SEED_SWEEP[n], 4, 64)[1] for n in "ABCDEF"] == [2, 4, 8, 8, 8, 16]


# ---------------------------------------------------------------- exercise 2: the largest bubble

def _bubble_table(configs, world, micro, gbs, share=False):
    out = {}
    for n, (tp, pp, cp) in configs.items():
        m = gbs // (micro * (world // (tp * pp * cp)))
        out[n] = (pp - 1) / (m + pp - 1 if share else m)
    return out


def largest(configs, world, micro, gbs):
    b = _bubble_table(configs, world, micro, gbs)
    return max(b, key=b.get)


def largest_share(configs, world, micro, gbs):        # (p-1)/(m+p-1) ranks configs the same way
    b = _bubble_table(configs, world, micro, gbs, share=True)
    return max(b, key=b.get)


def deepest(configs, world, micro, gbs):
    return max(configs, key=lambda n: configs[n][1])


def smallest(configs, world, micro, gbs):
    b = _bubble_table(configs, world, micro, gbs)
    return min(b, key=b.get)


@pytest.mark.parametrize("fn, ok, text", [
    (largest, True, "✓ largest_bubble"),
    (largest_share, True, "✓ largest_bubble"),
    (deepest, False, "depth alone does not decide"),
    (smallest, False, "that is the *smallest* bubble"),
    (_todo, False, "not attempted yet: write largest_bubble"),
])
def test_check_largest_bubble(fn, ok, text, capsys):
    assert L.check_largest_bubble(fn) is ok
    assert text in capsys.readouterr().out


def test_bubble_cases_include_ones_where_the_deepest_pipeline_is_not_the_answer():
    answers = [largest(*case) for case in L.BUBBLE_CASES]
    deepest_answers = [deepest(*case) for case in L.BUBBLE_CASES]
    assert answers[0] == "E" and any(a != d for a, d in zip(answers, deepest_answers))


# ---------------------------------------------------------------- exercise 3: one log line

def parse(line):
    out = {}
    for field in line.split("|"):
        name, _, value = field.rpartition(":")
        if "iteration" in field and "/" in field and "elapsed" not in field:
            out["iteration"] = int(field.split("iteration")[-1].split("/")[0])
        elif name.strip() == "elapsed time per iteration (ms)":
            out["elapsed_ms"] = float(value)
        elif name.strip() == "lm loss":
            out["lm_loss"] = float(value)
    return out


def parse_assumes_first_field(line):
    f = line.split("|")
    return {"iteration": int(f[0].split()[1].split("/")[0]), "elapsed_ms": float(f[2].split(":")[1]),
            "lm_loss": float(f[5].split(":")[1])}


def parse_total_iterations(line):
    d = parse(line)
    d["iteration"] = int(line.split("iteration")[1].split("/")[1].split("|")[0])
    return d


def parse_missing_loss(line):
    d = parse(line)
    del d["lm_loss"]
    return d


@pytest.mark.parametrize("fn, ok, text", [
    (parse, True, "✓ parse_iteration_line reads 5 formats"),
    (parse_assumes_first_field, False, "since core 0.6 the line starts with a '[date time]' stamp"),
    (parse_total_iterations, False, "take the number before the '/'"),
    (parse_missing_loss, False, "return a dict with the keys iteration, elapsed_ms, lm_loss"),
    (_todo, False, "not attempted yet: write parse_iteration_line"),
])
def test_check_parse_line(fn, ok, text, capsys):
    assert L.check_parse_line(fn) is ok
    assert text in capsys.readouterr().out


def test_checker_lines_are_the_fixtures_formats():
    """Each sample line is read by the course parser exactly as the fixture logs of its era."""
    from course_lib.megatron import parse_log

    eras = {name: parse_log(line).era for name, line in L.ITERATION_LINES.items()}
    assert eras == {"Megatron before core 0.6": "pre-0.6", "Megatron core 0.6-0.15": "0.6-0.15",
                    "Megatron core 0.16+": "0.16+", "the course's CPU log": "0.16+",
                    "torchrun --tee (prefix)": "0.6-0.15"}
