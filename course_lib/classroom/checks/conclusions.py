"""The student's conclusions of the Day 22 sweep (Lab 05, exercise 5), the course's reading, the report.

The conclusions (review question 6, checklist item 10, the deliverable) are the student's:
:func:`check_conclusions` only checks that they are written, that the choices name a config of A-F,
and that they cite numbers from this notebook's runs (:func:`measured_numbers`, :func:`cited_numbers`);
:func:`print_course_reading` shows the course's reading after them, and :func:`with_your_conclusions`
puts them into the deliverable report. None of them raises.
"""

from __future__ import annotations

import math
import re

from course_lib.classroom.checks import not_attempted
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.tamper_guard import run_student
from course_lib.classroom.checks.verdicts import safe_repr

CONCLUSIONS = {
    "tiny_gpt": "your choice from A-F for the seed's tiny GPT, and why",
    "gpt_13b": "your choice from A-F for the 13B GPT, and why",
    "rule": "your own rule for when to use TP, PP, DP and CP",
    "sweep": "the conclusions of your sweep (for the deliverable)",
}
LABELS = {"tiny_gpt": "My choice for the seed's tiny GPT", "gpt_13b": "My choice for the 13B GPT",
          "rule": "My rule for TP, PP, DP and CP", "sweep": "What my sweep shows"}
CHOICES = ("tiny_gpt", "gpt_13b")
CITING = ("tiny_gpt", "gpt_13b", "sweep")
_SETTINGS = {"name", "tp", "pp", "dp", "cp", "vp", "world_size", "iters", "micro_batches", "timeline", "command",
             "launcher", "run", "run_name", "model", "config", "notes", "num_microbatches", "global_batch_size",
             "micro_batch_size", "total_s", "wall_s"}
_CLOCK = {"step_time_ms", "tokens_per_s", "bubble", "step time (ms)", "tokens/s"}
"""What a run's clock measured: citable, but never the same twice, so the success line does not show it."""
_NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")
_SCALES = (1.0, 2.0 ** 20, 1e9, 1e6)


def measured_numbers(*sources, clock: bool = True) -> list[float]:
    """Every number in the runs' summaries and the sizing plans (and its value in MB and GB), plus each
    config's step time relative to A: what a conclusion may cite. Settings (TP, PP, iterations...) are left out;
    with ``clock=False`` also what the clock measured (step times, tokens/s, bubbles), which varies run to run."""
    found: list[float] = []

    def walk(obj, key=None):
        if key in _SETTINGS or (not clock and key in _CLOCK):
            return
        if isinstance(obj, bool):
            return
        if isinstance(obj, (int, float)):
            found.extend(obj / scale for scale in _SCALES)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, k)
            configs = obj.get("configs")
            if clock and isinstance(configs, list):
                base = next((c for c in configs if isinstance(c, dict) and c.get("name") == "A"), None)
                for c in configs:
                    if base and isinstance(c, dict) and c.get("step_time_ms") and base.get("step_time_ms"):
                        found.append(c["step_time_ms"] / base["step_time_ms"])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, key)
        elif hasattr(obj, "__dataclass_fields__"):  # a sizing Plan
            for name in obj.__dataclass_fields__:
                walk(getattr(obj, name), name)
            comm = getattr(obj, "comm", None)
            if isinstance(comm, dict):
                walk(comm.get("tp", 0) + comm.get("cp", 0))

    for source in sources:
        walk(source)
    return found


def cited_numbers(text: str, numbers: list[float]) -> list[str]:
    """The numbers written in ``text`` that match a measured one at the precision written (or within 1%);
    whole numbers below 10 (TP 2, PP 4...) are not citations."""
    cited = []
    for match in _NUMBER.finditer(text):
        whole, decimals = match.group(1).replace(",", ""), match.group(2)
        value = float(whole + ("." + decimals if decimals else ""))
        if decimals is None and value < 10:
            continue
        places = len(decimals) if decimals else 0
        if any(round(n, places) == value or math.isclose(n, value, rel_tol=0.01) for n in numbers):
            cited.append(match.group(0))
    return cited


def _conclusion_problem(key: str, text, numbers) -> str | None:
    if not isinstance(text, str) or len(text.split()) < 8 or text.strip().strip(".…").upper() in ("", "TODO"):
        return f"{key!r}: write {CONCLUSIONS[key]} -- a few sentences (got {safe_repr(text, 40)})"
    if key in CHOICES and not re.search(r"\b[A-F]\b", text):
        return f"{key!r}: name the config you choose, one of A-F"
    if key == "rule" and len(set(re.findall(r"\b(TP|PP|DP|CP)\b", text.upper()))) < 2:
        return f"{key!r}: say when to use each of TP, PP, DP and CP (name at least two of them)"
    if key in CITING and not cited_numbers(text, numbers):
        return (f"{key!r}: cite at least one number from this notebook's runs or tables, as it was printed "
                f"(a step time, tokens/s, MB per rank, a count of all-reduces, GB per rank from the sizing table...)")
    return None


@exercise("my_conclusions")
def check_conclusions(fn, *sources) -> bool:
    """``fn() -> {"tiny_gpt", "gpt_13b", "rule", "sweep": str}``: the student's own conclusions. A light
    check: each written, the choices name a config, and the answers cite a number measured or computed in
    ``sources`` (sweep summaries, sizing plans)."""
    run = run_student(fn, references=references_for("my_conclusions"))
    if run.todo:
        return not_attempted("my_conclusions")
    if run.problem():
        print(f"✗ my_conclusions: {run.problem()}")
        return False
    answers = run.value
    if not isinstance(answers, dict):
        print(f"✗ my_conclusions returned {safe_repr(answers)}: return a dict with the keys {', '.join(CONCLUSIONS)}")
        return False
    numbers = measured_numbers(*sources)
    problems = [_conclusion_problem(key, answers.get(key), numbers) for key in CONCLUSIONS]
    problems = [p for p in problems if p]
    if problems:
        print("✗ not yet: " + problems[0] + "".join(f"\n  also {p}" for p in problems[1:]))
        return False
    steady = measured_numbers(*sources, clock=False)      # the line must read the same on every run
    cites = "; ".join(f"{key}: {', '.join(cited_numbers(answers[key], steady)[:3]) or 'a measured time'}"
                      for key in CITING)
    print(f"✓ your conclusions are written, and they cite numbers from the run ({cites}); recorded for your "
          f"instructor (what they say is not graded here); now read the course's")
    return True


def _course_choice(plans: dict) -> str | None:
    """The course's rule: the simplest layout that fits -- least model parallelism (TP*PP*CP), then least traffic."""
    fits = [n for n, p in plans.items() if p.fits]
    return min(fits, key=lambda n: (plans[n].config["tp"] * plans[n].config["pp"] * plans[n].config["cp"],
                                    sum(plans[n].comm.values()))) if fits else None


def print_course_reading(sized: dict, unlocked: bool) -> None:
    """The course's reading of review question 6 (``sized``: {model name: {config: Plan}}), once the
    student's own conclusions are written (``unlocked``)."""
    if not unlocked:
        print("(the course's reading appears here once your conclusions above pass the check)")
        return
    for model, plans in sized.items():
        choice = _course_choice(plans)
        gpu = next(iter(plans.values())).gpu_memory_bytes / 1e9
        if choice is None:
            print(f"{model}: no layout of A-F fits in {gpu:.0f} GB: add recomputation, more GPUs or the "
                  f"distributed optimizer")
            continue
        p = plans[choice]
        mp = p.config["tp"] * p.config["pp"] * p.config["cp"]
        if mp == 1:
            print(f"{model}: {choice} -- {p.memory['total'] / 1e9:.2f} GB per rank of {gpu:.0f} GB: data "
                  f"parallelism alone fits, so no TP all-reduces, no bubble, the simplest command.")
            continue
        a = plans.get("A")
        start = f"A needs {a.memory['total'] / 1e9:.2f} GB per rank, more than {gpu:.0f} GB: " if a else ""
        print(f"{model}: {choice} -- {start}of the layouts that fit, {choice} has the least model parallelism "
              f"(TP*PP*CP = {mp}) and then the least traffic:")
        for name, q in plans.items():
            if q.fits:
                print(f"   {name}: {q.memory['total'] / 1e9:6.2f} GB/rank, TP+CP {(q.comm['tp'] + q.comm['cp']) / 1e9:7.2f} GB, "
                      f"PP {q.comm['pp'] / 1e9:5.2f} GB, DP {q.comm['dp'] / 1e9:5.2f} GB per rank per step, "
                      f"bubble {q.bubble:.3f}")
    print("Rule of thumb: TP inside a node (NVLink) until a layer fits; PP across nodes for depth, with m >= 4p; "
          "DP for the rest (with the distributed optimizer when the optimizer state does not fit); CP when the "
          "sequence is long. TP's traffic is fine over NVLink, painful across nodes.")


def with_your_conclusions(report: str, fn) -> str:
    """The deliverable ``report`` with its conclusions section rewritten: the student's conclusions
    (``fn()``, Exercise 5) first, the sentences the numbers support after them."""
    run = run_student(fn)
    answers = run.value if run.error is None and isinstance(run.value, dict) else None
    if answers:
        mine = [f"- **{LABELS[k]}:** {answers.get(k, '…')}" for k in CONCLUSIONS]
    else:
        mine = ["- (not written yet: write `my_conclusions` in §6 of the Lab 05 notebook)"]
    lines = report.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("## ") and "Conclusions" in line), None)
    if start is None:
        return "\n".join(lines + ["", "## Conclusions", "", *mine, ""])
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    generated = [line for line in lines[start + 1:end] if line.strip() and not line.startswith("- Your choice")]
    section = [lines[start], "", "### Mine", "", *mine, "", "### What the numbers say (generated from the run)", "",
               *generated, ""]
    return "\n".join(lines[:start] + section + lines[end:])
