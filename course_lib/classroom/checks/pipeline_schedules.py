"""Checkers for the pipeline schedules (Lab 03): 1F1B's warm-up and order, peak memory, orders run on ranks.

Each checker calls the student's function on many settings, compares with the
course's tested implementation (Megatron's order, the simulator, the formulas),
prints one verdict line and, when wrong, the most specific hint it can find. A
function that still raises ``NotImplementedError`` gets a "not attempted yet" line.
Every checker returns True/False and never raises.

* ``check_warmup(fn)``, ``check_order(fn)``: 1F1B's warm-up count and per-rank order.
  A wrong order is matched against known mistakes on *every* setting (on 2 stages and
  2 micro-batches a warm-up one step too long *is* GPipe's order; on the others it is
  not), so the hint names the real mistake.
* ``check_peak_memory(fn)``: per-rank peaks as any sequence of integers.
* ``check_orders_on_ranks(orders)``: the student's own per-rank 1F1B orders run on real
  ranks by :func:`course_lib.pipeline.executor.execute` (Megatron's paired send/recv); a
  deadlock becomes a hint naming the first blocked message, and the gradients and each
  rank's measured peak memory are checked.

The bubble exercise is in :mod:`course_lib.classroom.checks.pipeline_bubbles`.
"""

from __future__ import annotations

from typing import Callable, Optional

from course_lib.classroom.checks import call_student, not_attempted, outcome, refused_call
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import as_real, as_whole, drawn_rng, safe_repr, whole_numbers
from course_lib.pipeline.bubbles import bubble_fraction
from course_lib.pipeline.check import _check_complete, _check_dependencies, check_schedule, simulate_p2p
from course_lib.pipeline.schedules import (build_schedule, from_orders, num_warmup_microbatches, parse_action,
                                           schedule_1f1b)
from course_lib.pipeline.simulate import simulate

SETTINGS = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 6, 8, 12)]


def drawn_settings(rng, count: int = 3) -> list:
    """:data:`SETTINGS` and ``count`` deeper pipelines ``(p, m)`` drawn for this run (5-12 stages, 5-24
    micro-batches, fewer or more than p), so no table of the fixed settings answers a checker."""
    return SETTINGS + [(rng.randint(5, 12), rng.randint(5, 24)) for _ in range(count)]


_call, _todo = call_student, not_attempted


@exercise("warmup_1f1b")
def check_warmup(fn) -> bool:
    """``fn(pp_size, num_microbatches, pp_rank) -> int``: 1F1B's warm-up forwards on one rank."""
    for p, m in drawn_settings(drawn_rng()):
        for r in range(p):
            got, err = _call(fn, p, m, r, references=references_for("warmup_1f1b"))
            if refused_call(err):
                return False
            if err == "todo":
                return _todo("warmup_1f1b")
            want = num_warmup_microbatches(p, m, r)
            value = None if err else as_whole(got)
            if value != want:
                print(f"✗ warmup_1f1b({p}, {m}, {r}) {outcome(got, err)}")
                if value == p - r - 1:
                    print("  hint: with fewer micro-batches than stages a rank cannot warm up with more "
                          "forwards than there are micro-batches: cap it at m")
                elif value in (p - r, min(p - r, m)):
                    print("  hint: one forward too many: the last rank (r = p-1) needs no warm-up at all -- it "
                          "runs B0 right after F0, since the loss is computed there; rank r needs p - r - 1")
                elif value in (r, min(r, m)):
                    print("  hint: it is the *first* stage that waits longest for its first gradient: "
                          "count the stages after rank r")
                elif not err and value is None:
                    print(f"  hint: return a whole number of forwards ({as_real(got)[1] or 'an integer'})")
                else:
                    print("  hint: rank r must run F until its first gradient can arrive: that is the "
                          "number of stages after it, p - r - 1 (but never more than m)")
                return False
    print(f"✓ warmup_1f1b equals Megatron's min(p - r - 1, m) on every rank of {len(SETTINGS) + 3} (p, m) settings "
          f"(3 drawn for this run)")
    return True


# ---- exercise 2: the order, and the mistakes that give another order ------------------------------


def _one_f_one_b(m: int, warmup: int, backward_first: bool = False) -> list:
    """A 1F1B-shaped order with the given warm-up (Megatron's when ``warmup = min(p - r - 1, m)``)."""
    warmup = max(0, min(warmup, m))
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"B{i}", f"F{warmup + i}"] if backward_first else [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - warmup, m)]


ORDER_MISTAKES: dict[str, tuple[Callable, str]] = {
    "warm-up one step too long": (
        lambda p, m, r: _one_f_one_b(m, p - r),
        "the warm-up is one forward too long: rank r runs p - r - 1 forwards before its first backward "
        "(the last rank none: B0 right after F0); each extra warm-up forward is one more micro-batch held"),
    "warm-up one step too short": (
        lambda p, m, r: _one_f_one_b(m, p - r - 2),
        "the warm-up is one forward too short: rank r must run p - r - 1 forwards before the first gradient "
        "can come back from the p - r - 1 stages after it"),
    "backward before forward in the steady state": (
        lambda p, m, r: _one_f_one_b(m, min(p - r - 1, m), backward_first=True),
        "in the steady state each step is one forward F(w + i) *then* one backward B(i): the forward keeps "
        "the next stage busy while the gradient travels back"),
    "GPipe": (
        lambda p, m, r: [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)],
        "that is GPipe (all forwards, then all backwards): after the warm-up, alternate one forward and one "
        "backward"),
    "warm-up the same on every rank": (
        lambda p, m, r: _one_f_one_b(m, p - 1),
        "every rank warms up with p - 1 forwards; rank r needs only the number of stages after it, p - r - 1"),
}


def _as_strings(got) -> Optional[list]:
    try:
        return [str(parse_action(a)) for a in got]
    except (ValueError, TypeError):
        return None


def _matching_mistake(answers: dict) -> Optional[str]:
    """The hint of the known mistake whose orders equal the student's on *every* (p, m, r) answered."""
    for make, hint in ORDER_MISTAKES.values():
        if all(got == make(p, m, r) for (p, m, r), got in answers.items()):
            return hint
    return None


@exercise("order_1f1b")
def check_order(fn) -> bool:
    """``fn(pp_size, num_microbatches, pp_rank) -> list`` of "F0"/"B0" strings (or Actions)."""
    answers, wrong = {}, []
    for p, m in drawn_settings(drawn_rng()):
        for r in range(p):
            got, err = _call(fn, p, m, r, references=references_for("order_1f1b"))
            if refused_call(err):
                return False
            if err == "todo":
                return _todo("order_1f1b")
            if err:
                print(f"✗ order_1f1b({p}, {m}, {r}) raised {err}")
                return False
            strings = _as_strings(got)
            if strings is None:
                print(f"✗ order_1f1b({p}, {m}, {r}) must return a list of strings like 'F0', 'B0'; got "
                      f"{safe_repr(got)}")
                return False
            answers[(p, m, r)] = strings
            if strings != [str(a) for a in schedule_1f1b(p, m, r)]:
                wrong.append((p, m, r))
    if not wrong:
        print(f"✓ order_1f1b equals Megatron's forward_backward_pipelining_without_interleaving order "
              f"for {len(SETTINGS) + 3} (p, m) settings (3 drawn for this run), every rank")
        return True
    # show a pipeline deep enough to read (on 1 or 2 stages several mistakes give the same order)
    p, m, r = next((key for key in wrong if 3 <= key[0] <= 4 and key[1] >= 4), wrong[0])
    got, want = answers[(p, m, r)], [str(a) for a in schedule_1f1b(p, m, r)]
    print(f"✗ order_1f1b({p}, {m}, {r}) = {' '.join(got)} is not 1F1B's order on rank {r} of {p}")
    hint = _matching_mistake(answers)
    if hint is None and sorted(got) != sorted(want):
        hint = "each micro-batch needs exactly one F and one B on every rank"
    if hint is None:
        orders = [answers[(p, m, q)] for q in range(p)]
        try:
            check_schedule(from_orders(orders), "batched")
        except ValueError as exc:
            print(f"  the schedule checker says: {exc}")
        hint = ("warm-up forwards first, then steady pairs F(w + i), B(i), then the remaining backwards -- "
                "backwards go in micro-batch order 0, 1, 2, ...")
    print(f"  hint: {hint}")
    return False


# ---- exercise 4: peak memory ----------------------------------------------------------------------


@exercise("peak_activations")
def check_peak_memory(fn) -> bool:
    """``fn(pp, num_microbatches, schedule) -> list`` of peak micro-batches held per rank."""
    settings = drawn_settings(drawn_rng())
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p, m in settings:
            got, err = _call(fn, p, m, name, references=references_for("peak_activations"))
            if refused_call(err):
                return False
            if err == "todo":
                return _todo("peak_activations")
            want = simulate(build_schedule(name, p, m)).peak_activations
            values = None if err else whole_numbers(got)
            if values != want:
                print(f"✗ peak_activations({p}, {m}, {name!r}) {outcome(got, err)}: not the peak the schedule's "
                      f"simulation holds on every rank")
                if name == "1f1b" and values == [min(p - r - 1, m) for r in range(p)]:
                    print("  hint: off by one -- after the warm-up a rank runs one more forward before "
                          "its first backward frees anything")
                elif name == "1f1b" and values == [m] * p:
                    print("  hint: that is GPipe; in 1F1B each backward frees a micro-batch, so a rank "
                          "holds only its warm-up forwards plus one")
                elif name == "zb-h1":
                    print("  hint: in ZB-H1 a micro-batch is freed by its W, which rank r runs r "
                          "backwards late: every rank ends up holding as many as rank 0")
                elif values is None and not err:
                    print("  hint: return one whole number per rank, e.g. [4, 3, 2, 1]")
                else:
                    print("  hint: walk the rank's order: +1 at each F, -1 when the micro-batch's last "
                          "backward piece runs; take the maximum")
                return False
    print("✓ peak_activations equals the simulated peaks of GPipe, 1F1B and ZB-H1 on every rank")
    return True


# ---- exercise 5: your orders on real ranks ---------------------------------------------------------

RANKS_P, RANKS_M = 3, 4
"""The pipeline of exercise 5: 3 stages, 4 micro-batches."""


def _student_orders(orders, p: int, m: int):
    """``(list of per-rank string lists, None)`` or ``(None, verdict line)``; ``orders`` is the list itself,
    a function returning it, or an ``order_1f1b``-style function of ``(p, m, r)``."""
    if callable(orders):
        got, err = _call(orders, references=references_for("orders_1f1b_by_hand"))
        if err and "missing" in err and "positional" in err:  # an order_1f1b(p, m, r)
            per_rank = []
            for r in range(p):
                one, err = _call(orders, p, m, r, references=references_for("orders_1f1b_by_hand"))
                if err:
                    return None, err.removeprefix("LibraryPatched: ")
                per_rank.append(one)
            got, err = per_rank, None
        if err:
            return None, err.removeprefix("LibraryPatched: ")
        orders = got
    if not isinstance(orders, (list, tuple)) or len(orders) != p:
        return None, f"give {p} lists, one per pipeline rank (got {safe_repr(orders)})"
    out = []
    for r, order in enumerate(orders):
        strings = _as_strings(order) if isinstance(order, (list, tuple)) else None
        if strings is None:
            return None, f"rank {r}'s order must be a list of strings like 'F0', 'B0' (got {safe_repr(order)})"
        out.append(strings)
    return out, None


def _schedule_problem(orders: list, p: int, m: int) -> Optional[str]:
    """Why the orders cannot be a schedule of ``m`` micro-batches (missing, repeated, B before F), or None."""
    ids = sorted({int(a[1:]) for order in orders for a in order})
    if ids and ids[-1] >= m:
        return f"micro-batch {ids[-1]} does not exist: there are {m}, numbered 0 to {m - 1}"
    try:
        schedule = from_orders(orders)
        _check_complete(schedule)
    except ValueError as exc:
        return str(exc)
    if schedule.num_microbatches != m:
        return f"every rank runs F and B of all {m} micro-batches"
    return None


def _first_blocked(schedule) -> str:
    """The first blocked message of a schedule that deadlocked on real ranks (the checker's account)."""
    try:
        _check_dependencies(schedule)
    except ValueError as exc:
        return str(exc)
    try:
        simulate_p2p(schedule, "batched")
    except ValueError as exc:
        return str(exc)
    return "no message is blocked in the simulation: the ranks were slower than the timeout"


@exercise("orders_1f1b_by_hand")
def check_orders_on_ranks(orders, timeout: float = 6) -> bool:
    """Run the student's per-rank orders for 3 stages and 4 micro-batches on 3 real ranks.

    ``orders``: a list of 3 lists like ``["F0", "F1", "B0", ...]``, a function returning it, or an
    ``order_1f1b(p, m, r)`` function. They run through the pipeline executor with Megatron's paired
    send/recv (``batch_isend_irecv``); the gradients must equal the unsplit model's and rank r may hold at
    most ``min(p - r, m)`` micro-batches (1F1B's memory). Any order that does both passes."""
    from course_lib.launch import LaunchTimeout, RankError
    from course_lib.pipeline.executor import execute
    from course_lib.pipeline.stages import StackConfig, reference_gradients

    p, m = RANKS_P, RANKS_M
    per_rank, problem = _student_orders(orders, p, m)
    if problem == "todo":
        return _todo("orders_1f1b_by_hand")
    if problem:
        print(f"✗ {problem}")
        return False
    problem = _schedule_problem(per_rank, p, m)
    if problem:
        print(f"✗ these orders cannot run: {problem}")
        return False
    schedule = from_orders(per_rank, name="yours")
    cfg = StackConfig(num_layers=6)
    try:
        run = execute(schedule, cfg, p2p="batched", check=False, timeout=timeout)
    except LaunchTimeout as exc:
        print(f"✗ on {p} real ranks the pipeline hung (ranks {exc.unfinished} still waiting after {timeout:g} s): "
              f"a deadlock")
        print(f"  first blocked message: {_first_blocked(schedule)}")
        print("  hint: a rank can only run F(i) once stage r-1 has sent micro-batch i, and B(i) once stage r+1 "
              "has sent its gradient; each send is posted together with the next receive (Megatron's "
              "send_forward_recv_backward), so both neighbours must be at matching steps")
        return False
    except RankError as exc:
        print(f"✗ on {p} real ranks, rank {exc.rank} failed: {exc.traceback.strip().splitlines()[-1]}")
        print(f"  first blocked message: {_first_blocked(schedule)}")
        return False
    _, reference = reference_gradients(cfg, m)
    error = run.max_grad_error(reference)
    if error > 1e-5:
        print(f"✗ the gradients differ from the unsplit model's by {error:.1e}")
        return False
    simulated = simulate(schedule, 1.0, 2.0).bubble_fraction
    if simulated > bubble_fraction(p, m) + 1e-9:
        print(f"✗ your orders run and give the right gradients, but they idle more than 1F1B: simulated bubble "
              f"{simulated:.3f} of the useful time (t_b = 2 t_f), 1F1B's (p-1)/m = {bubble_fraction(p, m):.3f}")
        print("  hint: a rank that waits for B(i) before sending F(i+1) on serialises the pipeline; rank r needs "
              "p - r - 1 warm-up forwards to keep the stages after it busy while the first gradient comes back")
        return False
    limit = [min(p - r, m) for r in range(p)]
    peaks = run.timeline.peak_activations
    over = [r for r in range(p) if peaks[r] > limit[r]]
    if over:
        r = over[0]
        print(f"✗ your orders run and give the right gradients, but rank {r} held {peaks[r]} micro-batches at "
              f"once (measured: {peaks}); 1F1B holds at most min(p - r, m) = {limit}")
        print("  hint: " + ("that is GPipe's memory: " if peaks == [m] * p else "")
              + "start each rank's backwards as soon as the first gradient can arrive -- after p - r - 1 "
                "warm-up forwards -- and alternate F and B from then on")
        return False
    megatron = per_rank == [[str(a) for a in schedule_1f1b(p, m, r)] for r in range(p)]
    memory = "exactly Megatron's 1F1B order" if megatron else f"within 1F1B's bound {limit}"
    print(f"✓ your orders ran on {p} real ranks with Megatron's paired send/recv: gradients equal the unsplit "
          f"model's (within 1e-5), peak micro-batches held per rank {peaks} ({memory})")
    return True
