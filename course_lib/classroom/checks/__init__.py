"""Exercise checkers, one module per kind of exercise: they print a specific hint when an answer is wrong.

==========================  =======================================================================  ========
module                      exercises                                                                 labs
==========================  =======================================================================  ========
``collectives``             a ring all-reduce from send/recv; all-reduce = reduce-scatter + all-gather  00
``grad_sync``               the bucketed gradient all-reduce of data parallelism                      00
``rank_grid``               DP and micro-batches of a layout, every group of a rank, the rank order   01, 05
``tensor_parallel``         column- and row-parallel linear, the TP MLP from a dense one              02
``tp_communication``        the f/g operators, the collectives of a TP layer predicted                02
``vocab_parallel``          the vocab-parallel cross-entropy                                          02
``pipeline_schedules``      1F1B's warm-up and order, peak memory, your orders on real ranks          03
``pipeline_bubbles``        the bubble of a schedule, the largest bubble of a sweep                   03, 05
``context_parallel``        the log-sum-exp merge, ring attention, the zigzag split                   04
``training_logs``           one Megatron iteration line, every log era                                05
``distributed_optimizer``   Megatron's distributed optimizer step, the ZeRO-1 step, on ranks          05, 07
``conclusions``             the sweep's conclusions, the course's reading, the report                 05
``gpu_projection``          which config of A-F wins on 8 x H100                                      05
``sizing``                  the parameter count of Eq. 2, model states per GPU                        06
``zero_stages``             ZeRO's bytes per rank by stage, what a ds_config shards                   07
``moe``                     the expert groups, the all-to-all dispatch, the aux loss                  08
``checkpoints``             a TP layer's sharded state dict on ranks, the read plan of a reshard      09
``review``                  the student's answers to the review questions                             07, 08
==========================  =======================================================================  ========

Every checker runs in the **judge** (:mod:`~course_lib.classroom.checks.judge`), a clean process the student's
code never runs in: the checker cell hands it the student's function as source
(:mod:`~course_lib.classroom.checks.student_code`) and its arguments as plain data
(:mod:`~course_lib.classroom.checks.plain`); the function runs only in worker processes (or on the checker's
ranks) where the exercise's answer -- the course's references, the real libraries, the checker modules --
is refused (:mod:`~course_lib.classroom.checks.refusals`). So nothing the exercise cell does to the kernel
changes a verdict. Within the judge, one proof mechanism serves them all:

* **The course's own answer is refused, however wrapped.** :mod:`~course_lib.classroom.checks.references`
  names, for every exercise, the course code that computes its answer; :func:`call_student`,
  :func:`checked_call` and :func:`~course_lib.classroom.checks.tamper_guard.run_student` refuse it when
  it runs inside the student's call (directly, through a wrapper or a partial, or as a copy of its
  code), and refuse every function of the checker modules themselves (their truth tables, their
  input generators) the same way.
* **Where the lesson is an algorithm on ranks, it is proven by the wire.** The checked process
  group (:mod:`~course_lib.classroom.checks.wire`) records every op and *what it carried*; each
  rank's inputs are drawn from ``os.urandom`` on that rank, so no rank can rebuild another's and
  the right numbers need the real exchange; the truth is computed after the student's function
  returned, by the checker's own collectives; and where the lesson is blockwise compute (ring
  attention) the largest tensor the rank built is measured too.
* **Where the lesson is a formula, it asks for the parts** (ZeRO's bytes as params / grads /
  optimizer), so a confusion shows in the part it is in.

Every checker prints one verdict line and never raises: when the student's
function still raises ``NotImplementedError`` it prints "not attempted yet",
so the student notebook runs top to bottom before any exercise is solved.
Every checker is declared with :func:`~course_lib.classroom.checks.exercise.exercise`
(``@exercise("derive_dp")``) and returns a structured
:class:`~course_lib.classroom.checks.exercise.Verdict` (ok, exercise, hint, evidence),
which ``python -m course_lib grade`` collects.
Every checker prints that line through :func:`not_attempted`, and calls the
student's code through :func:`call_student` (or :func:`try_student` when it
needs the exception itself); checkers that run it on ranks test
``RankError.exc_type == "NotImplementedError"``.

Both undo any monkeypatch the student's function made (see
:func:`course_lib.classroom.checks.tamper_guard.run_student`) and report it as a
:class:`~course_lib.classroom.checks.tamper_guard.LibraryPatched` error, so a patched
``F.linear`` or ``RankGrid`` can neither fool a checker nor leak into later
cells. The robust comparisons and the communication checks are in
:mod:`course_lib.classroom.checks.verdicts`, the recording process group in
:mod:`course_lib.classroom.checks.wire`.
"""

from course_lib.classroom.checks.judge_client import warm_up as _warm_up

_warm_up()  # in a notebook: the judge starts importing while the student reads the first cells



def try_student(fn, *args, references=()):
    """``(value, None)``, or ``(None, exception)`` when ``fn`` raised, patched the library (a
    :class:`~course_lib.classroom.checks.tamper_guard.LibraryPatched`; the patch is undone) or ran the course's
    own code (``references``, and any checker function: a ``LibraryPatched`` naming it too)."""
    from course_lib.classroom.checks.tamper_guard import LibraryPatched, run_student

    run = run_student(fn, *args, references=references)
    if run.patched or run.course_code:
        return None, LibraryPatched(run.problem())
    if run.error is not None:
        return None, run.error
    return run.value, None


def call_student(fn, *args, references=()):
    """``(value, None)``, or ``(None, message)`` when ``fn`` raised; ``NotImplementedError`` -> ``(None, "todo")``."""
    value, exc = try_student(fn, *args, references=references)
    if exc is None:
        return value, None
    if isinstance(exc, NotImplementedError):
        return None, "todo"
    return None, f"{type(exc).__name__}: {exc}"


def refused_call(message) -> bool:
    """Print the verdict when a :func:`call_student` message says the call patched the library or ran the
    course's own code (nothing about the value can help then); True when printed."""
    prefix = "LibraryPatched: "
    if isinstance(message, str) and message.startswith(prefix):
        print(f"✗ {message[len(prefix):]}")
        return True
    return False


def outcome(value, message) -> str:
    """A :func:`call_student` result in words: ``"raised ValueError: ..."`` or ``"returned 0.5"``."""
    from course_lib.classroom.checks.verdicts import safe_repr

    return f"raised {message}" if message else f"returned {safe_repr(value)}"


def checked_call(fn, *args, references=()):
    """``(value, None)``, ``(None, "todo")`` for the stub, or ``(None, what went wrong)``: an exception,
    a monkeypatch (undone), or the course's own code (``references``) running inside the call."""
    from course_lib.classroom.checks.tamper_guard import run_student

    run = run_student(fn, *args, references=references)
    if run.todo:
        return None, "todo"
    problem = run.problem()
    return (None, problem) if problem else (run.value, None)


def is_course_answer(*fns) -> bool:
    """Print the verdict for an answer that *is* the course's own implementation; True when one is."""
    from course_lib.classroom.checks.tamper_guard import course_code_hint, course_function

    for fn in fns:
        name = course_function(fn)
        if name:
            print(f"✗ {course_code_hint(name)}")
            return True
    return False


def raised_line(err) -> str:
    """The last non-empty line of a rank's traceback (``err``: a ``RankError``), else its exception name."""
    lines = [line for line in err.traceback.strip().splitlines() if line.strip()]
    return lines[-1] if lines else err.exc_type


def not_attempted(name: str) -> bool:
    """Print the "not attempted yet" verdict for exercise ``name``; return False."""
    print(f"not attempted yet: write {name} above, then re-run this cell")
    return False
