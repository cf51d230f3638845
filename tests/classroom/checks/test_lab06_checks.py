"""Lab 06's checkers: each wrong accounting rejected with the hint that names it, right answers written
differently (Eq. 2's float form, Fraction, numpy, a 0-d tensor, rounded to whole bytes) accepted, NaN refused,
stubs "not attempted", the course's own functions recognised. No ranks: these run in milliseconds."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from course_lib import sizing
from course_lib.classroom.checks import sizing as sizing_checks


def _todo(*args):
    raise NotImplementedError


class Weird:
    """An answer whose comparisons raise: a checker must still give a verdict."""

    def __eq__(self, other):
        raise RuntimeError("no comparing me")

    __ne__ = __lt__ = __float__ = __eq__
    __hash__ = None


# ---------------------------------------------------------------- Exercise 1: Eq. 2

def params_ok(l, h, v, s):
    return l * (12 * h * h + 13 * h) + (v + s) * h


def params_eq2_float(l, h, v, s):                   # the paper's form, in floating point
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


def params_fraction(l, h, v, s):
    return Fraction(params_ok(l, h, v, s))


def params_numpy(l, h, v, s):
    return np.int64(params_ok(l, h, v, s))


def params_tensor(l, h, v, s):
    return torch.tensor(float(params_ok(l, h, v, s)), dtype=torch.float64)


@pytest.mark.parametrize("fn, ok, text", [
    (params_ok, True, "✓ gpt_parameters"),
    (params_eq2_float, True, "✓ gpt_parameters"),
    (params_fraction, True, "✓ gpt_parameters"),
    (params_numpy, True, "✓ gpt_parameters"),
    (params_tensor, True, "✓ gpt_parameters"),
    (_todo, False, "not attempted yet: write gpt_parameters"),
    (lambda l, h, v, s: 12 * l * h * h, False, "12lh² is only the weight matrices"),
    (lambda l, h, v, s: l * 12 * h * h + (v + s) * h, False, "misses the biases and LayerNorms"),
    (lambda l, h, v, s: l * (12 * h * h + 4 * h) + (v + s) * h, False, "misses the biases"),
    (lambda l, h, v, s: l * (12 * h * h + 9 * h) + (v + s) * h, False, "misses the two LayerNorms"),
    (lambda l, h, v, s: l * (12 * h * h + 11 * h) + (v + s) * h, False, "a gain *and* a bias"),
    (lambda l, h, v, s: l * (12 * h * h + 13 * h) + v * h, False, "position embedding"),
    (lambda l, h, v, s: l * (12 * h * h + 13 * h) + s * h, False, "the word embedding"),
    (lambda l, h, v, s: l * (12 * h * h + 13 * h), False, "misses the embeddings"),
    (lambda l, h, v, s: params_ok(l, h, v, s) + v * h, False, "the output layer is tied"),
    (lambda l, h, v, s: params_ok(l, h, v, s) + 2 * h, False, "final LayerNorm"),
    (lambda l, h, v, s: params_ok(l, h, v, s) - 4 * l * h * h, False, "the MLP goes h -> 4h -> h"),
    (lambda l, h, v, s: params_ok(l, h, v, s) / 1e9, False, "not billions"),
    (lambda l, h, v, s: float("nan"), False, "NaN"),
    (lambda l, h, v, s: str(params_ok(l, h, v, s)), False, "return a number, not its text"),
    (lambda l, h, v, s: np.array([params_ok(l, h, v, s)] * 2), False, "return one number"),
    (lambda l, h, v, s: Weird(), False, "return a number"),
    (sizing.num_parameters, False, "the course's own"),
    (lambda l, h, v, s: sizing.num_parameters(l, h, v, s), False, "the course's own"),
])
def test_check_gpt_parameters(fn, ok, text, capsys):
    assert sizing_checks.check_gpt_parameters(fn).ok is ok
    out = capsys.readouterr().out
    assert text in out, out


def test_parameter_cases_tell_every_term_apart():
    """On the small shapes every term a count can miss has its own size, so each hint is unambiguous."""
    for l, h, v, s in sizing_checks.PARAMETER_CASES[:2]:
        terms = [t for t, _ in sizing_checks._parameter_terms(l, h, v, s)]
        assert len(set(terms)) == len(terms), (l, h, v, s)


# ---------------------------------------------------------------- Exercise 2: model states per GPU

def states_ok(params, tp, dp, cp, distributed):
    return params * (2 + 4 + (12 / (dp * cp) if distributed else 12))


def states_fraction_whole_bytes(params, tp, dp, cp, distributed):
    return round(Fraction(params) * (6 + (Fraction(12, dp * cp) if distributed else 12)))


@pytest.mark.parametrize("fn, ok, text", [
    (states_ok, True, "✓ model_state_bytes_per_gpu"),
    (states_fraction_whole_bytes, True, "✓ model_state_bytes_per_gpu"),
    (lambda p, tp, dp, cp, dist: np.float64(states_ok(p, tp, dp, cp, dist)), True, "✓ model_state_bytes_per_gpu"),
    (_todo, False, "not attempted yet: write model_state_bytes_per_gpu"),
    (lambda p, tp, dp, cp, dist: p * 16, False, "ZeRO's count with 16-bit gradients"),
    (lambda p, tp, dp, cp, dist: p * (6 + (12 / dp if dist else 12)), False, "*and* context-parallel"),
    (lambda p, tp, dp, cp, dist: p * (6 + (12 / (tp * dp * cp) if dist else 12)), False, "not TP"),
    (lambda p, tp, dp, cp, dist: p * 18 / (dp * cp if dist else 1), False, "stay whole on every GPU"),
    (lambda p, tp, dp, cp, dist: p * 18, False, "divided by d = dp·cp"),
    (lambda p, tp, dp, cp, dist: p * (4 + 16 / (dp * cp) if dist else 20), False, "fp16-parameters"),
    (lambda p, tp, dp, cp, dist: states_ok(p, tp, dp, cp, dist) / tp, False, "do not divide it by TP again"),
    (lambda p, tp, dp, cp, dist: states_ok(p, tp, dp, cp, dist) / 1e9, False, "return bytes, not GB"),
    (lambda p, tp, dp, cp, dist: float("inf"), False, "infinite"),
    (lambda p, tp, dp, cp, dist: None, False, "returned None"),
    (sizing.megatron_optimizer_bytes_per_param, False, "the course's own"),
])
def test_check_model_state_bytes(fn, ok, text, capsys):
    assert sizing_checks.check_model_state_bytes(fn).ok is ok
    out = capsys.readouterr().out
    assert text in out, out


def test_a_table_of_the_fixed_cases_fails_on_the_drawn_ones(capsys):
    """Counts and bytes looked up for the fixed cases fail on the cases drawn per run; the line shows the
    student's value, never the right one."""
    counts = {case: sizing.num_parameters(*case) for case in sizing_checks.PARAMETER_CASES}
    assert sizing_checks.check_gpt_parameters(lambda *case: counts.get(case, 1)).ok is False
    out = capsys.readouterr().out
    assert "returned 1, not Eq. 2's count" in out and "expected" not in out, out
    states = {case: states_ok(*case) for case in sizing_checks.STATE_CASES}
    assert sizing_checks.check_model_state_bytes(lambda *case: states.get(case, 1.0)).ok is False
    out = capsys.readouterr().out
    assert "returned 1.0" in out and "expected" not in out, out
