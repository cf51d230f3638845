"""Checker for reading a training log (Lab 05): one Megatron iteration line, in every log era.

``check_parse_line(fn)``: ``fn(line) -> {"iteration": int, "elapsed_ms": float, "lm_loss": float}`` on one
iteration line per Megatron log era (before core 0.6, 0.6-0.15, 0.16+; the format strings of
``megatron/training/training.py``'s ``training_log``), the course's own CPU log and a torchrun
``--tee`` prefixed line, against :func:`course_lib.training.logs.parse_log`. Numbers of any real type are
accepted; a monkeypatch is undone, and an answer that runs the course's parser is told so. It prints one
verdict line ("not attempted yet" while the stub raises NotImplementedError) and, when wrong, the most
specific hint it can find; it never raises.
"""

from __future__ import annotations

import math
import re

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import as_real, as_whole, drawn_rng, safe_repr
from course_lib.training.logs import parse_log

# One iteration line per Megatron log era (format strings read in NVIDIA/Megatron-LM; see
# course_lib.training.logs), plus the course's own and a torchrun --tee prefixed one.
ITERATION_LINES = {
    "Megatron before core 0.6": " iteration       10/      50 | consumed samples:          640 | elapsed time per "
                                "iteration (ms): 1450.3 | learning rate: 3.000E-04 | global batch size:    64 | "
                                "lm loss: 1.051234E+01 | loss scale: 1.0 | grad norm: 12.345 | number of skipped "
                                "iterations:   0 | number of nan iterations:   0 |",
    "Megatron core 0.6-0.15": " [2025-10-04 17:56:47] iteration       20/      40 | consumed samples:         1280 | "
                              "elapsed time per iteration (ms): 640.2 | throughput per GPU (TFLOP/s/GPU): 32.6 | "
                              "learning rate: 2.200000E-04 | global batch size:    64 | lm loss: 8.250000E+00 | "
                              "loss scale: 1.0 | grad norm: 3.250 | number of skipped iterations:   0 | number of "
                              "nan iterations:   0 |",
    "Megatron core 0.16+": " [2026-02-26 04:05:51.004213] iteration        1/      30 | consumed samples:           64 "
                           "| elapsed time per iteration (ms): 5321.4 | learning rate: 3.000000E-05 | global batch "
                           "size:    64 | lm loss: 1.087000E+01 | loss scale: 1.0 | grad norm: 25.125 | number of "
                           "skipped iterations:   0 | number of nan iterations:   0 |",
    "the course's CPU log": " [2026-08-22 15:22:23.000000] iteration        5/      20 | consumed samples:  "
                            "         80 | elapsed time per iteration (ms): 95.5 | learning rate: 1.000000E-03 | "
                            "global batch size:    16 | lm loss: 4.900000E+00 | loss scale: 1.0 | grad norm: "
                            "1.000 | number of skipped iterations:   0 | number of nan iterations:   0 |",
    "torchrun --tee (prefix)": "[default7]: [2025-10-04 17:57:02] iteration       40/      40 | consumed samples:  "
                               "       2560 | elapsed time per iteration (ms): 655.9 | learning rate: 3.000000E-05 | "
                               "global batch size:    64 | lm loss: 7.125000E+00 | loss scale: 1.0 | grad norm: "
                               "2.125 | number of skipped iterations:   0 | number of nan iterations:   0 |",
}
KEYS = ("iteration", "elapsed_ms", "lm_loss")


def drawn_line(line: str, rng, below_one: bool = False) -> str:
    """``line`` with its iteration, iteration count, time and loss drawn for this run (in the line's own
    formats and widths), so no table of the fixed lines answers. With ``below_one`` the loss is under 1, so it is
    written with a negative exponent (``7.5E-01``), which none of the fixed lines shows."""
    total = rng.randint(20, 500000)
    line = re.sub(r"iteration(\s+)(\d+)/(\s*)(\d+)",
                  lambda m: f"iteration {rng.randint(1, total):{len(m[1]) + len(m[2]) - 1}d}/"
                            f"{total:{len(m[3]) + len(m[4])}d}", line, count=1)
    line = re.sub(r"\(ms\): [\d.]+", lambda m: f"(ms): {rng.uniform(20, 20000):.1f}", line, count=1)
    loss = rng.uniform(0.05, 0.99) if below_one else rng.uniform(0.5, 12)
    return re.sub(r"lm loss: (\d)\.(\d+)E([+-]\d+)", lambda m: f"lm loss: {loss:.{len(m[2])}E}", line, count=1)


def drawn_lines(rng) -> dict:
    """This run's line of every era of :data:`ITERATION_LINES` (:func:`drawn_line`), one of them (drawn) with a
    loss under 1: drawn alone, a loss under 1 (a negative exponent) came up in only 1 run in 5."""
    low = rng.randrange(len(ITERATION_LINES))
    return {era: drawn_line(line, rng, below_one=i == low) for i, (era, line) in enumerate(ITERATION_LINES.items())}


def _reads_it_at_or_above_one(fn, line: str) -> bool:
    """Does ``fn`` read ``line`` right once its loss's exponent is made positive (``7.5E-01`` -> ``7.5E+01``)?
    Then only the negative exponent of a loss below 1 stops it."""
    line = re.sub(r"(lm loss: \d\.\d+E)-", r"\1+", line, count=1)
    got, err = checked_call(fn, line, references=references_for("parse_iteration_line"))
    ref = parse_log(line).iterations[0]
    return not err and _parsed_ok(got, {k: ref[k] for k in KEYS})


def _parsed_ok(got, want) -> bool:
    """The three fields, numbers of any real type, equal to the reference (the iteration a whole number)."""
    if not isinstance(got, dict) or any(k not in got for k in KEYS):
        return False
    for key in KEYS:
        number, reason = as_real(got[key])
        if reason or not math.isclose(number, want[key], rel_tol=1e-9, abs_tol=1e-12):
            return False
    return as_whole(got["iteration"]) is not None


@exercise("parse_iteration_line")
def check_parse_line(fn) -> bool:
    """``fn(line) -> {"iteration": int, "elapsed_ms": float, "lm_loss": float}``."""
    if is_course_answer(fn):
        return False
    for era, line in drawn_lines(drawn_rng()).items():
        got, err = checked_call(fn, line, references=references_for("parse_iteration_line"))
        if err == "todo":
            return not_attempted("parse_iteration_line")
        ref = parse_log(line).iterations[0]
        want = {k: ref[k] for k in KEYS}
        if not err and _parsed_ok(got, want):
            continue
        print(f"✗ {era}: parse_iteration_line {err or 'returned ' + safe_repr(got, 200)}")
        wrong = []
        if not err and isinstance(got, dict) and all(k in got for k in KEYS):
            wrong = [k for k in KEYS if not _parsed_ok({**want, k: got[k]}, want)]
            print(f"  {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not what the line says")
        if ((err or "").startswith("raised") or "lm_loss" in wrong) and ref["lm_loss"] < 1 \
                and _reads_it_at_or_above_one(fn, line):
            print("  hint: a loss below 1 is written with a negative exponent (e.g. 7.5E-01): read the whole number "
                  "with float(), the exponent's sign included")
        elif err and err.startswith("raised") and "[" in line.split("iteration")[0]:
            print("  hint: " + ("torchrun --tee puts '[defaultN]:' in front of every line" if "default" in line else
                                "since core 0.6 the line starts with a '[date time]' stamp")
                  + ": find the 'iteration N/ M' field instead of assuming it comes first")
        elif err and err.startswith("raised"):
            print("  hint: split the line on '|'; each field is 'name: value' (rpartition(':') keeps names with "
                  "colons intact); the first field is 'iteration N/ M'")
        elif err:
            pass  # a patch or the course's parser: the line above says it
        elif not isinstance(got, dict) or any(k not in got for k in KEYS):
            print(f"  hint: return a dict with the keys {', '.join(KEYS)}")
        elif as_real(got["iteration"])[0] == ref["train_iters"]:
            print("  hint: 'iteration 10/ 50' is iteration 10 of 50: take the number before the '/'")
        elif as_whole(got["iteration"]) is None:
            print("  hint: the iteration is a whole number: int(...)")
        else:
            print("  hint: 'elapsed time per iteration (ms)' and 'lm loss' are floats (1.05E+01 parses with float())")
        return False
    print(f"✓ parse_iteration_line reads {len(ITERATION_LINES)} formats: Megatron pre-0.6, 0.6-0.15, 0.16+, the "
          f"course's, and torchrun-prefixed lines (with numbers drawn for this run)")
    return True
