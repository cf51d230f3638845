"""Checkers for the pipeline bubble: its formula (Lab 03), and which layout idles most (Lab 05).

* ``check_bubble(fn)``: ``fn(pp, num_microbatches, vp)``, bubble time over ideal time, against the
  simulated 1F1B and interleaved schedules (:mod:`course_lib.pipeline.simulate`). Any real number
  type is accepted (``Fraction(p - 1, v * m)``, a float64 tensor, numpy); NaN, infinities and
  non-numbers are refused with a reason.
* ``check_largest_bubble(fn)``: ``fn(configs, world_size, micro_batch_size, global_batch_size)``, the
  name of the config with the largest 1F1B bubble ``(p-1)/m``, ``m = global / (micro · DP)`` and DP
  from :func:`course_lib.rules.data_parallel_size`. A wrong pick is matched against the usual
  mistakes (CP counted into DP, depth alone, the smallest bubble) on *every* sweep.

Each prints one verdict line ("not attempted yet" while the stub raises NotImplementedError) and,
when wrong, the most specific hint it can find; neither raises.
"""

from __future__ import annotations

import math

from course_lib.classroom.checks import (call_student, checked_call, is_course_answer, not_attempted, outcome,
                                        refused_call)
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import drawn_rng, safe_repr, same_number
from course_lib.topology.seed import SEED_SWEEP
from course_lib.pipeline.bubbles import bubble_fraction
from course_lib.pipeline.schedules import build_schedule
from course_lib.pipeline.simulate import simulate
from course_lib.rules import data_parallel_size


# ---- Lab 03, exercise 3: the bubble of a schedule ---------------------------------------------------

@exercise("bubble")
def check_bubble(fn) -> bool:
    """``fn(pp, num_microbatches, vp) -> number``: bubble time over ideal time (any real type), on a grid of
    settings and 4 drawn for this run."""
    rng = drawn_rng()
    drawn = [(rng.randint(3, 12), rng.randint(3, 40), vp) for vp in (1, 1, 2, 3)]
    grid = [(p, m, vp) for p in (1, 2, 4, 8) for m in (1, 4, 8, 16) for vp in (1, 2)]
    for p, m, vp in grid + drawn:
        got, err = call_student(fn, p, m, vp, references=references_for("bubble"))
        if refused_call(err):
            return False
        if err == "todo":
            return not_attempted("bubble")
        name = "1f1b" if vp == 1 else "interleaved"
        try:
            simulated = simulate(build_schedule(name, p, m, vp), 1.0, 2.0).bubble_fraction
        except ValueError:
            simulated = bubble_fraction(p, m, vp)  # interleaved needs m % p == 0
        verdict = same_number(got, simulated, rel=1e-6) if not err else None  # float32 answers too
        if verdict:
            continue
        print(f"✗ bubble({p}, {m}, {vp}) {outcome(got, err)}: not what the simulated "
              f"{'1F1B' if vp == 1 else 'interleaved'} schedule idles, as a share of its useful time")
        value = verdict.value if verdict is not None else None
        if err:
            print("  hint: compute it from p, m and vp: (p - 1) idle steps against m useful ones")
        elif value is None:
            print(f"  hint: {verdict.reason}")
        elif abs(value - (p - 1) / (vp * m + p - 1)) < 1e-9:
            print("  hint: that is the share of the *whole* iteration, (p-1)/(m+p-1); here we "
                  "divide the bubble by the ideal (useful) time m * (t_f + t_b)")
        elif abs(value - (p - 1) / m) < 1e-9 and vp > 1:
            print("  hint: with v chunks per rank each bubble step is v times shorter")
        elif (p - 1) % (vp * m) and value == (p - 1) // (vp * m):
            print("  hint: integer division (//) rounds the fraction down to a whole number: use /")
        else:
            print("  hint: the first micro-batch needs p - 1 steps to reach the last stage and "
                  "p - 1 to come back; compare that with m steps of useful work")
        return False
    print(f"✓ bubble equals the simulated 1F1B and interleaved schedules for {len(grid) + len(drawn)} (p, m, v) "
          f"settings ({len(drawn)} drawn for this run)")
    return True


# ---- Lab 05, exercise 2: the largest bubble of a sweep ---------------------------------------------

# name -> (tp, pp, cp) sets and batch settings where depth alone does not decide, and where ignoring CP
# in DP picks a config that is *not* the deepest (the last one), so each mistake has its own answers.
BUBBLE_CASES = [
    (dict(SEED_SWEEP), 8, 1, 16),
    (dict(SEED_SWEEP), 8, 4, 64),
    ({"X": (1, 2, 1), "Y": (1, 4, 1)}, 8, 1, 8),
    ({"P": (2, 2, 2), "Q": (1, 2, 1)}, 8, 1, 8),
    ({"R": (1, 4, 2), "S": (1, 2, 1)}, 16, 2, 32),
    ({"T": (4, 2, 1), "U": (1, 1, 1), "V": (2, 4, 1)}, 16, 1, 32),
    ({"G": (1, 2, 4), "H": (2, 4, 1)}, 16, 1, 16),
]


def _fits(world: int, tp: int, pp: int, cp: int) -> bool:
    """Whether ``world`` ranks hold the layout (:func:`course_lib.rules.data_parallel_size` accepts it)."""
    try:
        data_parallel_size(world, tp, pp, cp)
    except ValueError:
        return False
    return True


def drawn_sweeps(rng, count: int = 2) -> list:
    """``count`` sweeps drawn for this run, shaped like :data:`BUBBLE_CASES`: 3 configs named by random
    letters on 8 or 16 ranks, one with CP, a global batch every config's micro * DP divides."""
    sweeps = []
    for _ in range(count):
        world = rng.choice((8, 16))
        layouts = [(tp, pp, cp) for tp in (1, 2, 4) for pp in (1, 2, 4, 8) for cp in (1, 2)
                   if _fits(world, tp, pp, cp)]
        chosen = rng.sample([l for l in layouts if l[2] == 1], 2) + [rng.choice([l for l in layouts if l[2] == 2])]
        rng.shuffle(chosen)
        names = rng.sample("ABCDEFGHJKLMNPQRSTUVWXYZ", 3)
        micro = rng.randint(1, 2)
        sweeps.append((dict(zip(names, chosen)), world, micro, micro * world * rng.randint(1, 4)))
    return sweeps


def _bubbles(configs, world, micro, gbs, dp_of=data_parallel_size):
    """``{name: (p-1)/m}`` with m = global / (micro * DP); ``dp_of`` may be a mistaken DP."""
    return {name: (pp - 1) / (gbs / (micro * dp_of(world, tp, pp, cp))) for name, (tp, pp, cp) in configs.items()}


def _largest(values: dict) -> set:
    top = max(values.values())
    return {n for n, v in values.items() if math.isclose(v, top, rel_tol=1e-12)}


# Each mistake as a rule giving the set of names it picks, and the hint it gets. Ignoring DP altogether
# (m = global / micro) makes m the same for every config, so it picks the deepest: it is "depth alone".
BUBBLE_MISTAKES = [
    (lambda c, w, mi, g: _largest(_bubbles(c, w, mi, g, lambda w_, t, p, cp: data_parallel_size(w_, t, p))),
     "CP ranks are not data-parallel replicas: DP = world / (TP * PP * CP) -- ignoring CP doubles a CP config's "
     "DP and halves its micro-batches"),
    (lambda c, w, mi, g: {n for n in c if c[n][1] == max(p for _, p, _ in c.values())},
     "depth alone does not decide: compute m = global / (micro * DP) for each config; (p-1)/m grows when a "
     "config has few micro-batches"),
    (lambda c, w, mi, g: {min((b := _bubbles(c, w, mi, g)), key=b.get)},
     "that is the *smallest* bubble: take the config with the largest (p-1)/m"),
]


@exercise("largest_bubble")
def check_largest_bubble(fn) -> bool:
    """``fn(configs: {name: (tp, pp, cp)}, world_size, micro_batch_size, global_batch_size) -> name``
    of the config with the largest 1F1B bubble (p-1)/m."""
    if is_course_answer(fn):
        return False
    answers, first_wrong = [], None
    cases = BUBBLE_CASES + drawn_sweeps(drawn_rng())
    for i, (configs, world, micro, gbs) in enumerate(cases):
        got, err = checked_call(fn, dict(configs), world, micro, gbs, references=references_for("largest_bubble"))
        if err == "todo":
            return not_attempted("largest_bubble")
        shown = ", ".join(f"{n}: TP{t} PP{p} CP{c}" for n, (t, p, c) in configs.items())
        if err:
            print(f"✗ largest_bubble({{{shown}}}, world {world}, micro {micro}, global {gbs}): {err}")
            return False
        answers.append(got)
        want = _largest(_bubbles(configs, world, micro, gbs))
        if first_wrong is None and not (isinstance(got, str) and got in want):
            first_wrong = (i, shown, want)
    if first_wrong is None:
        print(f"✓ largest_bubble right on {len(cases)} sweeps (the seed's A-F, and 2 drawn for this run; CP "
              f"counted out of DP)")
        return True
    i, shown, want = first_wrong
    configs, world, micro, gbs = cases[i]
    print(f"✗ largest_bubble({{{shown}}}, world {world}, micro {micro}, global {gbs}) = {safe_repr(answers[i])}: "
          f"not the config with the largest (p-1)/m")
    for rule, hint in BUBBLE_MISTAKES:  # the mistake that gives *every* one of the student's answers
        if all(isinstance(a, str) and a in rule(*case) for a, case in zip(answers, cases)):
            print(f"  hint: {hint}")
            break
    else:
        if not isinstance(answers[i], str) or answers[i] not in configs:
            print(f"  hint: return the *name* of a config, one of {', '.join(configs)}")
        else:
            print("  hint: bubble = (p-1)/m with m = global / (micro * DP) and DP = world / (TP * PP * CP)")
    return False

