"""``python -m course_lib pipeline``: print a schedule's per-rank order, bubble and activation memory.

    python -m course_lib pipeline --schedule 1f1b --pp 4 --microbatches 8
    python -m course_lib pipeline --schedule interleaved --pp 4 --microbatches 8 --vp 2
    python -m course_lib pipeline --schedule zb-h1 --pp 4 --microbatches 8 --t-b 1 --t-w 1

A simulation (no ranks are started); bad settings end with a one-line error, before any
work: times must be finite, ``--t-f``/``--t-b`` > 0 and ``--t-w`` >= 0, and the schedule is
at most ``MAX_PASSES`` (stage, micro-batch) pairs, pp x vp x microbatches, because the
simulation holds every pass in memory (pp 64 with 1024 micro-batches fits).
"""

from __future__ import annotations

import math

from course_lib.pipeline.bubbles import bubble_fraction
from course_lib.pipeline.check import check_schedule
from course_lib.pipeline.schedules import SCHEDULE_NAMES, build_schedule
from course_lib.pipeline.simulate import simulate
from course_lib.rules import UsageError


def add_arguments(parser) -> None:
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES)
    parser.add_argument("--pp", type=int, default=4, help="pipeline-model-parallel size")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per iteration")
    parser.add_argument("--vp", type=int, default=1, help="model chunks per rank (interleaved only)")
    parser.add_argument("--group", type=int, default=None,
                        help="microbatch-group-size-per-virtual-pipeline-stage (interleaved; default pp)")
    parser.add_argument("--t-f", type=float, default=1.0, help="forward time per micro-batch and stage")
    parser.add_argument("--t-b", type=float, default=2.0, help="backward time (B only, for zb-*)")
    parser.add_argument("--t-w", type=float, default=0.0, help="weight-gradient time (zb-*: the W pass)")
    parser.add_argument("--orders", action="store_true", help="print every rank's order")


MAX_PASSES = 65536  # pp x vp x microbatches: ~50 us and a few hundred bytes each to simulate


def check_arguments(args) -> None:
    """Refuse impossible times and schedules too large to simulate (one line, before any work)."""
    for flag, value, zero_ok in (("--t-f", args.t_f, False), ("--t-b", args.t_b, False), ("--t-w", args.t_w, True)):
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            rule = ">= 0 (0: no separate weight-gradient pass)" if zero_ok else "> 0"
            raise UsageError(f"{flag} {value} is not a time: give a finite number {rule}")
    sizes = (args.pp, args.vp, args.microbatches)
    if all(isinstance(n, int) and n >= 1 for n in sizes) and math.prod(sizes) > MAX_PASSES:
        raise UsageError(f"--pp {args.pp} x --vp {args.vp} x --microbatches {args.microbatches} = {math.prod(sizes)} "
                         f"(stage, micro-batch) passes; the simulation handles at most {MAX_PASSES}: lower "
                         f"--microbatches or --pp (a few times pp micro-batches already shows the bubble)")


def run(args) -> int:
    check_arguments(args)
    s = build_schedule(args.schedule, args.pp, args.microbatches, args.vp, args.group)
    p2p = check_schedule(s)
    tl = simulate(s, args.t_f, args.t_b, args.t_w)
    if args.orders:
        print(s.table())
    print(tl.summary())
    if args.schedule in ("gpipe", "1f1b", "interleaved"):
        print(f"formula (p-1)/(v m) = {bubble_fraction(args.pp, args.microbatches, args.vp):.4f}")
    print(f"deadlock-free point-to-point protocol: {p2p}")
    return 0
