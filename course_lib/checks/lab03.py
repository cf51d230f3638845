"""Checkers for Lab 03's exercises (pipeline parallel).

Each checker calls the student's function on many settings, compares with the
course's tested implementation (Megatron's order, the simulator, the formulas),
prints one verdict line and, when wrong, the most specific hint it can find. A
function that still raises ``NotImplementedError`` gets a "not attempted yet" line.
Every checker returns True/False and never raises.
"""

from __future__ import annotations

from course_lib.checks import call_student, not_attempted
from course_lib.pipeline.bubbles import bubble_fraction
from course_lib.pipeline.check import check_schedule
from course_lib.pipeline.schedules import (build_schedule, from_orders, num_warmup_microbatches, parse_action,
                                           schedule_1f1b, schedule_gpipe)
from course_lib.pipeline.simulate import simulate

SETTINGS = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 6, 8, 12)]


_call, _todo = call_student, not_attempted


def check_warmup(fn) -> bool:
    """``fn(pp_size, num_microbatches, pp_rank) -> int``: 1F1B's warm-up forwards on one rank."""
    for p, m in SETTINGS:
        for r in range(p):
            got, err = _call(fn, p, m, r)
            if err == "todo":
                return _todo("warmup_1f1b")
            want = num_warmup_microbatches(p, m, r)
            if err or got != want:
                print(f"✗ warmup_1f1b({p}, {m}, {r}) returned {err or repr(got)}, expected {want}")
                if got == p - r - 1:
                    print("  hint: with fewer micro-batches than stages a rank cannot warm up with more "
                          "forwards than there are micro-batches: cap it at m")
                elif got == p - r:
                    print("  hint: the last rank (r = p-1) needs no warm-up at all: it can run B0 right "
                          "after F0, since the loss is computed there")
                elif got == r or got == min(r, m):
                    print("  hint: it is the *first* stage that waits longest for its first gradient: "
                          "count the stages after rank r")
                else:
                    print("  hint: rank r must run F until its first gradient can arrive: that is the "
                          "number of stages after it, p - r - 1 (but never more than m)")
                return False
    print(f"✓ warmup_1f1b equals Megatron's min(p - r - 1, m) on {sum(p for p, _ in SETTINGS)} (p, m, rank) cases")
    return True


def check_order(fn) -> bool:
    """``fn(pp_size, num_microbatches, pp_rank) -> list`` of "F0"/"B0" strings (or Actions)."""
    for p, m in SETTINGS:
        orders = []
        for r in range(p):
            got, err = _call(fn, p, m, r)
            if err == "todo":
                return _todo("order_1f1b")
            if err:
                print(f"✗ order_1f1b({p}, {m}, {r}) raised {err}")
                return False
            try:
                got = [str(parse_action(a)) for a in got]
            except (ValueError, TypeError) as exc:
                print(f"✗ order_1f1b({p}, {m}, {r}) must return strings like 'F0', 'B0': {exc}")
                return False
            orders.append(got)
            want = [str(a) for a in schedule_1f1b(p, m, r)]
            if got == want:
                continue
            print(f"✗ order_1f1b({p}, {m}, {r}) = {' '.join(got)}")
            print(f"  expected           {' '.join(want)}")
            if got == [str(a) for a in schedule_gpipe(p, m, r)]:
                print("  hint: that is GPipe (all forwards, then all backwards): after the warm-up, "
                      "alternate one forward and one backward")
            elif sorted(got) != sorted(want):
                print("  hint: each micro-batch needs exactly one F and one B on every rank")
            else:
                try:
                    check_schedule(from_orders(orders + [want for _ in range(p - len(orders))]), "batched")
                except ValueError as exc:
                    print(f"  the checker says: {exc}")
                print("  hint: warm-up forwards first, then steady pairs F(w + i), B(i), then the "
                      "remaining backwards -- backwards go in micro-batch order 0, 1, 2, ...")
            return False
    print(f"✓ order_1f1b equals Megatron's forward_backward_pipelining_without_interleaving order "
          f"for {len(SETTINGS)} (p, m) settings, every rank")
    return True


def check_bubble(fn) -> bool:
    """``fn(pp, num_microbatches, vp) -> float``: bubble time over ideal time."""
    for p in (1, 2, 4, 8):
        for m in (1, 4, 8, 16):
            for vp in (1, 2):
                got, err = _call(fn, p, m, vp)
                if err == "todo":
                    return _todo("bubble")
                name = "1f1b" if vp == 1 else "interleaved"
                try:
                    simulated = simulate(build_schedule(name, p, m, vp), 1.0, 2.0).bubble_fraction
                except ValueError:
                    simulated = bubble_fraction(p, m, vp)  # interleaved needs m % p == 0
                if err or not isinstance(got, (int, float)) or abs(got - simulated) > 1e-9:
                    print(f"✗ bubble({p}, {m}, {vp}) returned {err or repr(got)}; the simulated schedule "
                          f"idles {simulated:.4f} of its useful time")
                    if isinstance(got, (int, float)) and abs(got - (p - 1) / (vp * m + p - 1)) < 1e-9:
                        print("  hint: that is the share of the *whole* iteration, (p-1)/(m+p-1); here we "
                              "divide the bubble by the ideal (useful) time m * (t_f + t_b)")
                    elif isinstance(got, (int, float)) and abs(got - (p - 1) / m) < 1e-9 and vp > 1:
                        print("  hint: with v chunks per rank each bubble step is v times shorter")
                    else:
                        print("  hint: the first micro-batch needs p - 1 steps to reach the last stage and "
                              "p - 1 to come back; compare that with m steps of useful work")
                    return False
    print("✓ bubble equals the simulated 1F1B and interleaved schedules for 32 (p, m, v) settings")
    return True


def check_peak_memory(fn) -> bool:
    """``fn(pp, num_microbatches, schedule) -> list`` of peak micro-batches held per rank."""
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p, m in SETTINGS:
            got, err = _call(fn, p, m, name)
            if err == "todo":
                return _todo("peak_activations")
            want = simulate(build_schedule(name, p, m)).peak_activations
            if err or list(got or []) != want:
                print(f"✗ peak_activations({p}, {m}, {name!r}) returned {err or got}; simulated {want}")
                if name == "1f1b" and got is not None and list(got) == [min(p - r - 1, m) for r in range(p)]:
                    print("  hint: off by one -- after the warm-up a rank runs one more forward before "
                          "its first backward frees anything")
                elif name == "1f1b" and got is not None and list(got) == [m] * p:
                    print("  hint: that is GPipe; in 1F1B each backward frees a micro-batch, so a rank "
                          "holds only its warm-up forwards plus one")
                elif name == "zb-h1":
                    print("  hint: in ZB-H1 a micro-batch is freed by its W, which rank r runs r "
                          "backwards late: every rank ends up holding as many as rank 0")
                else:
                    print("  hint: walk the rank's order: +1 at each F, -1 when the micro-batch's last "
                          "backward piece runs; take the maximum")
                return False
    print("✓ peak_activations equals the simulated peaks of GPipe, 1F1B and ZB-H1 on every rank")
    return True
