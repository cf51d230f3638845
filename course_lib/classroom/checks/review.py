"""The student's answers to a lab's review questions (Labs 07, 08 and 11): checked where a number is asked.

A lab's review questions are the student's to answer, as Lab 05's conclusions are
(:mod:`course_lib.classroom.checks.conclusions`): the student writes ``my_answers()``, returning a
dict with one entry per question; :func:`check_review_answers` checks each against the lab's
:data:`QUESTIONS` -- a :class:`Number` (the value, within a tolerance; a share may be written as a
fraction or a percentage), :class:`Ranks` (a list of whole numbers, any order), :class:`Choice`
(one of a few named answers, any spelling, said by its words: a letter or an index is refused, and a hint
lists the options in an order drawn for the run, so no position names an answer) or :class:`Prose` (a few sentences: never judged here,
since no word list tells a right explanation from the right words around a wrong one; it is recorded
for the instructor, whom ``python -m course_lib grade`` hands it) -- prints one line, and the hint of
the first wrong answer. The course's own reading is shown after it, once the answers are in. Never
raises; the stub's ``NotImplementedError`` gives "not attempted yet".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from course_lib.classroom.checks import not_attempted
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.tamper_guard import run_student
from course_lib.classroom.checks.verdicts import as_real, drawn_rng, safe_repr, whole_numbers

__all__ = ["Number", "Ranks", "Choice", "Prose", "QUESTIONS", "check_review_answers"]


@dataclass(frozen=True)
class Number:
    """A number within ``rel`` of ``value``; ``share``: a fraction that may also be written in percent."""

    value: float
    hint: str
    rel: float = 0.02
    share: bool = False


@dataclass(frozen=True)
class Ranks:
    """A list of whole numbers (any order)."""

    value: tuple
    hint: str


@dataclass(frozen=True)
class Choice:
    """One of ``options`` (name -> words that say it); ``value`` is the right one."""

    value: str
    options: dict
    hint: str


@dataclass(frozen=True)
class Prose:
    """A few sentences (at least ``words`` words) for the instructor to read: checked only as written, never
    by the words it uses; ``hint`` says what to write about."""

    hint: str
    words: int = 8


QUESTIONS = {
    "07": {
        "zero3_over_zero1_traffic": Number(
            1.5, "per step ZeRO-1 sends one reduce-scatter and one all-gather of N; ZeRO-3 gathers the "
                 "parameters before the forward *and* again before the backward: count the collectives of N"),
        "dp_that_halves_bf16_states": Number(
            4, "Megatron's bf16 count is 2 + 4 + 12/d bytes per parameter with the distributed optimizer "
               "(18 without): for which d is it 9?", rel=0.0),
        "why_bf16_needs_no_loss_scaler": Prose(
            "compare the exponent bits of bf16 and fp16: which smallest gradient does each keep, and what "
            "does the loss scale do about the other"),
    },
    "08": {
        "dense_dp": Number(2, "the dense layers: dp = world / (tp·pp·cp), whatever EP is", rel=0.0),
        "expert_dp": Number(2, "the expert layers: expert_dp = world / (expert_tp·ep·pp), with cp folded in",
                            rel=0.0),
        "experts_on_rank_13": Ranks(
            tuple(range(16, 32)), "rank 13's EP coordinate j in the expert grid gives it experts j·L .. j·L+L-1, "
                                  "L = 64 / ep"),
        "expert_share_ep4": Number(
            2048 / (2048 + 128), "per rank: the router (E·h, replicated) and 1/ep of the experts' two "
                                 "matrices (2·E·h·f): which share are the experts with EP 4?", share=True),
        "router_grads_summed_over": Choice(
            "dense DP", {"dense DP": ("dense", "dp", "data parallel", "dense dp"),
                         "expert DP": ("expert", "expert dp", "edp", "expert data parallel")},
            "the router is replicated like every dense weight: which group holds its copies?"),
        "expert_grads_summed_over": Choice(
            "expert DP", {"dense DP": ("dense", "dp", "data parallel", "dense dp"),
                          "expert DP": ("expert", "expert dp", "edp", "expert data parallel")},
            "an expert's copies live on the ranks that hold the *same* experts: which group is that?"),
        "top2_over_top1_traffic": Number(
            2.0, "each rank sends each of its T·k (token, expert) rows once: T·k·H elements, ≈ (ep−1)/ep of them off the rank"),
    },
    "11": {
        "samples_in_one_epoch": Number(
            4, "a sample is seq_length + 1 tokens and neighbours share one token: count the samples whose last token "
               "is still inside the epoch",
            rel=0.0),
        "epochs_for_100_samples": Number(
            25, "GPTDataset takes the fewest epochs whose tokens cover num_samples * seq_length + 1", rel=0.0),
        "split_cuts": Choice(
            "documents", {"documents": ("document", "docs", "doc"), "samples": ("sample", "sequences", "tokens")},
            "look at split_indices: what does --split 90,9,1 count before any sample exists?"),
        "why_append_eod": Prose(
            "samples run over document edges: what tells the model that one document ended and another began?"),
    },
}
"""lab -> question key -> what answers it. The questions themselves are in the lab's markdown."""


def _norm(text: str) -> str:
    return re.sub(r"[\s_-]+", " ", text.strip().lower())


_POSITION = re.compile(r"^\(?(option|choice|answer)?\s*([a-z]|\d+)\s*[).:]?$")


def _positional(answer) -> bool:
    """An answer that names an option by where it stood (``"b"``, ``"(2)"``, ``"option a"``, ``1``), not by its
    words."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        return True
    return isinstance(answer, str) and bool(_POSITION.match(_norm(answer)))


def _choice_problem(key: str, spec: "Choice", answer, rng) -> str | None:
    said = _norm(answer) if isinstance(answer, str) else None
    picked = [name for name, words in spec.options.items() if said in {_norm(w) for w in (name, *words)}]
    if picked == [spec.value]:
        return None
    names = list(spec.options)
    rng.shuffle(names)                     # no order of the options is the answer's position
    names = " or ".join(repr(n) for n in names)
    if not picked and _positional(answer):
        return (f"{key!r} = {safe_repr(answer)} names an option by its position; answer with its words: {names} "
                f"(listed in an order drawn for this run)\n  hint: {spec.hint}")
    return f"{key!r} = {safe_repr(answer)}: answer {names}\n  hint: {spec.hint}"


def _problem(key: str, spec, answer, rng) -> str | None:
    if isinstance(spec, Number):
        number, reason = as_real(answer)
        if reason:
            return f"{key!r}: {reason}"
        if spec.share and number > 1:
            number /= 100
        if abs(number - spec.value) > spec.rel * abs(spec.value) + 1e-9:
            return f"{key!r} = {safe_repr(answer)} is not it\n  hint: {spec.hint}"
        return None
    if isinstance(spec, Ranks):
        got = whole_numbers(answer)
        if got is None:
            return f"{key!r} = {safe_repr(answer)}: give the ranks as a list of whole numbers\n  hint: {spec.hint}"
        if sorted(got) != sorted(spec.value):
            return f"{key!r} = {safe_repr(answer)} is not it\n  hint: {spec.hint}"
        return None
    if isinstance(spec, Choice):
        return _choice_problem(key, spec, answer, rng)
    text = answer if isinstance(answer, str) else ""
    if len(text.split()) < spec.words or text.strip().strip(".…").upper() in ("", "TODO"):
        return f"{key!r}: write a few sentences (got {safe_repr(answer, 40)})\n  hint: {spec.hint}"
    return None  # prose is the instructor's to read: no word list passes or fails it


@exercise("my_answers_{lab}")
def check_review_answers(fn, lab: str) -> bool:
    """``fn() -> {question key: answer}``: the student's answers to lab ``lab``'s review questions
    (:data:`QUESTIONS`): numbers, ranks and choices checked; prose only checked as written, and recorded for
    the instructor."""
    questions = QUESTIONS[lab]
    run = run_student(fn, references=references_for(f"my_answers_{lab}"))
    if run.todo:
        return not_attempted("my_answers")
    if run.problem():
        print(f"✗ my_answers: {run.problem()}")
        return False
    answers = run.value
    if not isinstance(answers, dict) or set(answers) != set(questions):
        keys = ", ".join(map(repr, questions))
        got = sorted(answers) if isinstance(answers, dict) else safe_repr(answers)
        print(f"✗ my_answers returned {got}: return a dict with the keys {keys}")
        return False
    rng = drawn_rng()
    problems = [p for p in (_problem(k, spec, answers[k], rng) for k, spec in questions.items()) if p]
    if problems:
        print(f"✗ {len(questions) - len(problems)} of {len(questions)} answers right; first: {problems[0]}")
        return False
    prose = sum(isinstance(spec, Prose) for spec in questions.values())
    checked = f"the {len(questions) - prose} numbers, ranks and groups are right"
    read = (f"; {'the answer' if prose == 1 else f'the {prose} answers'} in prose recorded for your instructor "
            f"(not graded here)") if prose else ""
    print(f"✓ your {len(questions)} answers: {checked}{read} -- now read the course's reading below")
    return True
