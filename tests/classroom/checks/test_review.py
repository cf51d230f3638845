"""The review answers of Labs 07, 08 and 11 (:mod:`course_lib.classroom.checks.review`): numbers, ranks and
choices are checked (written differently they still pass, wrong they get the question's hint); prose is
recorded for the instructor, never passed or failed by the words it uses."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from course_lib.classroom.checks.review import QUESTIONS, Prose, check_review_answers

RIGHT_07 = {"zero3_over_zero1_traffic": 1.5, "dp_that_halves_bf16_states": 4,
            "why_bf16_needs_no_loss_scaler": "bf16 keeps the eight exponent bits of fp32, so small gradients stay "
                                             "normal numbers; fp16 flushes them to zero unless the loss is scaled."}
RIGHT_08 = {"dense_dp": 2, "expert_dp": 2, "experts_on_rank_13": list(range(16, 32)),
            "expert_share_ep4": 2048 / 2176, "router_grads_summed_over": "dense DP",
            "expert_grads_summed_over": "expert DP", "top2_over_top1_traffic": 2}
RIGHT_11 = {"samples_in_one_epoch": 4, "epochs_for_100_samples": 25, "split_cuts": "documents",
            "why_append_eod": "Samples run across document boundaries, so the end-of-document token tells the model "
                              "where one text ends and an unrelated one begins."}
RIGHT = {"07": RIGHT_07, "08": RIGHT_08, "11": RIGHT_11}


@pytest.mark.parametrize("lab, change, ok, words", [
    ("07", {}, True, ["✓ your 3 answers", "in prose recorded for your instructor (not graded here)"]),
    # right answers written differently
    ("07", {"zero3_over_zero1_traffic": Fraction(3, 2), "dp_that_halves_bf16_states": np.int64(4)}, True, ["✓"]),
    ("08", {"expert_share_ep4": 94.1176,  # a percentage "experts_on_rank_13": tuple(range(31, 15, -1)),
            "router_grads_summed_over": "data-parallel", "expert_grads_summed_over": "EDP"}, True,
     ["✓ your 7 answers: the 7 numbers"]),
    # prose that names none of the course's words still goes to the instructor: no keyword decides
    ("07", {"why_bf16_needs_no_loss_scaler": "Because the two sixteen bit formats split their bits differently "
                                             "between how wide and how fine they are."}, True,
     ["recorded for your instructor"]),
    # wrong ones: the question's hint, never the answer
    ("07", {"zero3_over_zero1_traffic": 2}, False, ["'zero3_over_zero1_traffic' = 2 is not it", "count the "
                                                                                                 "collectives"]),
    ("07", {"why_bf16_needs_no_loss_scaler": "TODO"}, False, ["write a few sentences", "compare the exponent"]),
    ("08", {"experts_on_rank_13": [0, 1, 2]}, False, ["[0, 1, 2] is not it", "EP coordinate"]),
    ("08", {"experts_on_rank_13": range(16, 32)}, True, ["✓ your 7 answers"]),
    ("08", {"experts_on_rank_13": "16 to 31"}, False, ["give the ranks as a list of whole numbers"]),
    ("08", {"router_grads_summed_over": "expert DP"}, False, ["'router_grads_summed_over' = 'expert DP': answer '",
                                                              "replicated"]),
    # an option named by its position, not its words: refused, whichever position would be right
    ("08", {"router_grads_summed_over": "a"}, False, ["names an option by its position; answer with its words"]),
    ("08", {"expert_grads_summed_over": 1}, False, ["names an option by its position"]),
    ("08", {"router_grads_summed_over": "(B)"}, False, ["names an option by its position"]),
    ("08", {"router_grads_summed_over": "option 1"}, False, ["names an option by its position"]),
    # Lab 11: right written differently, then wrong (the rule, never the value)
    ("11", {}, True, ["✓ your 4 answers"]),
    ("11", {"samples_in_one_epoch": np.int32(4), "epochs_for_100_samples": 25.0, "split_cuts": "Docs"}, True,
     ["✓"]),
    ("11", {"samples_in_one_epoch": 5}, False, ["'samples_in_one_epoch' = 5 is not it", "neighbours share one"]),
    ("11", {"epochs_for_100_samples": 24}, False, ["'epochs_for_100_samples' = 24 is not it", "fewest epochs"]),
    ("11", {"split_cuts": "samples"}, False, ["'split_cuts' = 'samples'", "split_indices"]),
    ("11", {"split_cuts": "b"}, False, ["names an option by its position"]),
])
def test_review_answers(lab, change, ok, words, capsys):
    right = RIGHT[lab]
    assert check_review_answers(lambda: {**right, **change}, lab).ok is ok
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out
    if not ok:  # the hint names the rule, never the right value
        assert "1.5" not in out and "16, 17" not in out and "expected" not in out and "25" not in out, out


def test_prose_has_no_word_list():
    """Prose carries what to write about (its hint), no words that would pass it."""
    for questions in QUESTIONS.values():
        for spec in questions.values():
            if isinstance(spec, Prose):
                assert set(vars(spec)) == {"hint", "words"}


def test_choice_options_are_listed_in_a_drawn_order(capsys):
    """The hint of a wrong choice lists the options in an order drawn per run: over 20 runs both orders of Lab 08's
    two options appear (all the same: probability 2**-19)."""
    orders = set()
    for _ in range(20):
        assert not check_review_answers(lambda: {**RIGHT_08, "router_grads_summed_over": "b"}, "08").ok
        out = capsys.readouterr().out
        orders.add(out.index("'dense DP'") < out.index("'expert DP'"))
    assert orders == {True, False}
