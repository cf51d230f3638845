"""Checkers for the rank grid: the layout's sizes, every group of a rank, the rank order.

* ``check_derive_dp(fn)`` (Lab 01): ``fn(world_size, tp, pp, cp) -> dp`` (ValueError when impossible)
* ``check_groups_of(fn)`` (Lab 01): ``fn(rank, layout) -> {"tp": [...], "cp": [...], "dp": [...], "pp": [...]}``,
  every rank of many layouts (``layout = {"world_size": 8, "tp": 2, "pp": 2, "cp": 1}``)
* ``check_rank_of(fn)`` (Lab 01): ``fn(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp) -> rank`` in
  Megatron's default order tp-cp-ep-dp-pp
* ``check_layout(fn)`` (Lab 05): ``fn(world_size, tp, pp, cp, micro_batch_size, global_batch_size) ->
  (dp, num_microbatches)`` (ValueError when Megatron refuses the layout)

Each prints one verdict line (✓ / ✗, or "not attempted yet" when the exercise
still raises NotImplementedError) and, when wrong, the most specific hint it can
find. Expected values come from ``course_lib.topology.RankGrid`` and ``ParallelConfig``
(the tests compare them with Megatron-LM's own algorithm) and the DP rule of
:func:`course_lib.rules.data_parallel_size`. The exercises ask for the arithmetic, so
an answer that calls ``RankGrid`` or ``ParallelConfig`` is told so; the student's
code runs through :func:`course_lib.classroom.checks.tamper_guard.run_student` (a monkeypatch of
``RankGrid`` is undone and reported). Any real integer type is a right answer.
"""

from __future__ import annotations

import itertools

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.tamper_guard import LibraryPatched, course_code_hint, run_student
from course_lib.classroom.checks.verdicts import as_real, as_whole, drawn_rng, safe_repr, whole_numbers
from course_lib.topology.seed import SEED_SWEEP
from course_lib.rules import data_parallel_size, num_microbatches
from course_lib.topology import ParallelConfig, RankGrid, divisors


def drawn_grids(rng, count: int) -> list:
    """``count`` grids ``(tp, cp, dp, pp)`` drawn for this run (each size 1-4, cp 1-3, at least two axes
    larger than 1): with the seed's fixed layouts first, no table of fixed cases answers the checkers. The
    first splits every axis (each size >= 2), so any two axes in the wrong order give a different rank."""
    grids = [(rng.randint(2, 4), rng.randint(2, 3), rng.randint(2, 4), rng.randint(2, 4))][:count]
    while len(grids) < count:
        grid = (rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4))
        if sum(n > 1 for n in grid) >= 2:
            grids.append(grid)
    return grids


def _drawn_layouts(rng, count: int) -> list:
    """``count`` possible layouts ``(world, tp, pp, cp)`` drawn for this run."""
    return [(tp * cp * dp * pp, tp, pp, cp) for tp, cp, dp, pp in drawn_grids(rng, count)]


def _drawn_impossible(rng, count: int) -> list:
    """``count`` layouts ``(world, tp, pp, cp)`` whose tp·pp·cp does not divide the world size."""
    out = []
    for tp, cp, dp, pp in drawn_grids(rng, count):
        out.append((tp * pp * cp * dp + rng.randint(1, tp * pp * cp - 1), tp, pp, cp))
    return out


def _call(fn, *args, exercise: str):
    """``(value, exception)`` of the student's call; a patch or the course's grid (the exercise's
    :func:`~course_lib.classroom.checks.references.references_for`) becomes the exception."""
    run = run_student(fn, *args, references=references_for(exercise))
    if run.patched:
        return None, LibraryPatched(run.problem())
    if run.error is not None and "[refused]" in str(run.error):  # the refusal it raised names itself
        return None, run.error
    if run.course_code:  # before another error: a refused file is why it raised
        return None, _CourseCode(course_code_hint(run.course_code[0]))
    if run.error is not None:
        return None, run.error
    return run.value, None


class _CourseCode(Exception):
    """The student's function ran the course's own implementation."""


def _verdict_for_exception(call: str, exc: BaseException) -> None:
    if isinstance(exc, (_CourseCode, LibraryPatched)):
        print(f"✗ {call}: {exc}")
    else:
        print(f"✗ {call} raised {type(exc).__name__}: {exc}")


# ---- Lab 01, exercise 1: derive DP -------------------------------------------------------------------

@exercise("derive_dp")
def check_derive_dp(fn) -> bool:
    """``fn(world_size, tp, pp, cp)`` must return world / (tp·pp·cp) and raise
    ValueError when tp·pp·cp does not divide the world size."""
    rng = drawn_rng()
    cases = [(8, 2, 2, 1), (8, 2, 2, 2), (128, 4, 4, 1), *_drawn_layouts(rng, 5)]
    for world, tp, pp, cp in cases:
        got, exc = _call(fn, world, tp, pp, cp, exercise="derive_dp")
        if isinstance(exc, NotImplementedError):
            return not_attempted("derive_dp")
        want = data_parallel_size(world, tp, pp, cp)
        if exc is not None:
            _verdict_for_exception(f"derive_dp({world}, tp={tp}, pp={pp}, cp={cp})", exc)
            return False
        value = as_whole(got)
        if value != want:
            print(f"✗ derive_dp({world}, tp={tp}, pp={pp}, cp={cp}) returned {safe_repr(got)}")
            if value is None and as_real(got)[1]:
                print(f"  hint: {as_real(got)[1]}")
            elif value is None:
                print("  hint: DP counts whole replicas: return an integer (use //, after checking divisibility)")
            elif value == data_parallel_size(world, tp, pp):  # CP left out
                print("  hint: context parallelism is a factor of the world size too: dp = world / (tp·pp·cp)")
            elif value == tp * pp * cp:
                print("  hint: that is the model-parallel size tp·pp·cp; dp is what is left: world / (tp·pp·cp)")
            else:
                print("  hint: every rank belongs to exactly one (tp, cp, dp, pp) cell: world = tp·pp·cp·dp")
            return False
    for world, tp, pp, cp in [(8, 3, 1, 1), *_drawn_impossible(rng, 2)]:
        got, exc = _call(fn, world, tp, pp, cp, exercise="derive_dp")
        if isinstance(exc, (_CourseCode, LibraryPatched)):
            _verdict_for_exception(f"derive_dp({world}, tp={tp}, pp={pp}, cp={cp})", exc)
            return False
        if not isinstance(exc, ValueError):
            what = f"returned {safe_repr(got)}" if exc is None else f"raised {type(exc).__name__}"
            print(f"✗ derive_dp({world}, tp={tp}, pp={pp}, cp={cp}) {what}; tp·pp·cp = {tp * pp * cp} does not "
                  f"divide {world}")
            print("  hint: raise ValueError naming the rule, e.g. "
                  f"'world_size={world} is not divisible by tp·pp·cp={tp * pp * cp}'")
            return False
        if "\n" in str(exc) or not str(exc):
            print("✗ the ValueError should be one line naming the rule and a fix")
            return False
    print(f"✓ derive_dp is right for {len(cases)} layouts (the seed's and 5 drawn for this run) and rejects 3 "
          f"impossible ones")
    return True


# ---- Lab 01, exercise 2: every group of a rank, for any layout ---------------------------------------

AXES = ("tp", "cp", "dp", "pp")
GROUP_LAYOUTS = [(8, 2, 2, 1), (16, 2, 2, 2), (12, 3, 1, 2)]
"""(world_size, tp, pp, cp): the seed's 8 = 2x2x2 first, then CP; the checker adds layouts drawn per run."""
DRAWN_GROUP_LAYOUTS = 4

_GROUP_HINTS = {
    "tp": "TP neighbours are consecutive ranks (tp varies fastest): rank r's TP group is the block of tp ranks "
          "starting at r - r % tp",
    "cp": "CP partners share tp rank, dp rank and stage; cp is the next axis after tp, so the stride is tp",
    "dp": "DP partners share tp rank, cp rank and stage; dp comes after tp and cp in tp-cp-ep-dp-pp, so the "
          "stride is tp·cp",
    "pp": "the PP group links the same (tp, cp, dp) position in every stage; a stage holds world/pp ranks, so "
          "the stride is world/pp = tp·cp·dp",
}


def layout_of(world: int, tp: int, pp: int, cp: int) -> dict:
    """The ``layout`` dict the exercise receives."""
    return {"world_size": world, "tp": tp, "pp": pp, "cp": cp}


def _student_groups(fn, layout: tuple, axis: str) -> list:
    """The student's ``axis`` group of every rank of ``layout`` (None where the call fails)."""
    out = []
    for rank in range(layout[0]):
        got, exc = _call(fn, rank, layout_of(*layout), exercise="groups_of")
        out.append(whole_numbers(got[axis]) if exc is None and isinstance(got, dict) and axis in got else None)
    return out


def _matching_order(fn, layout: tuple, axis: str):
    """The other rank order whose ``axis`` groups equal the student's for *every* rank of ``layout``."""
    world, tp, pp, cp = layout
    theirs = _student_groups(fn, layout, axis)
    for order, name in (("tp-dp-cp-pp", "order tp-dp-cp-pp (DP before CP)"),
                        ("tp-cp-pp-dp", "order tp-cp-pp-dp (PP before DP)"), ("pp-dp-cp-tp", "PP fastest")):
        try:
            grid = RankGrid(world, tp=tp, pp=pp, cp=cp, order=order)
        except ValueError:
            continue  # Megatron refuses some orders when cp > 1
        if all(grid.group_of(r, axis) == theirs[r] for r in range(world)):
            return name
    return None


def _group_mistake(fn, got, want: list, rank: int, axis: str, layout: tuple) -> list:
    """The verdict lines for one wrong group."""
    lines = [f"✗ groups_of({rank}, {layout_of(*layout)})[{axis!r}] = {safe_repr(got)} is not rank {rank}'s "
             f"{axis.upper()} group"]
    ints = whole_numbers(got)
    if ints is None:
        lines.append("  hint: give each group as a list of ints, e.g. [4, 5]")
    elif sorted(ints) == want:
        lines.append("  hint: right ranks, wrong order: list them in group-rank order (ascending here)")
    else:
        order = _matching_order(fn, layout, axis)
        if order:
            lines.append(f"  hint: those are the {axis.upper()} groups under {order}; Megatron's default "
                         f"tp-cp-ep-dp-pp puts tp fastest, then cp, dp, pp. {_GROUP_HINTS[axis]}")
        else:
            lines.append(f"  hint: {_GROUP_HINTS[axis]}")
        if rank not in ints:
            lines.append(f"  (rank {rank} must be in each of its own groups)")
    return lines


@exercise("groups_of")
def check_groups_of(fn) -> bool:
    """``fn(rank, layout) -> {"tp": [...], "cp": [...], "dp": [...], "pp": [...]}``: the four groups of
    ``rank`` (lists in group-rank order) for ``layout = {"world_size", "tp", "pp", "cp"}`` in Megatron's
    default order, for every rank of the layouts in :data:`GROUP_LAYOUTS`."""
    layouts = GROUP_LAYOUTS + _drawn_layouts(drawn_rng(), DRAWN_GROUP_LAYOUTS)
    for layout in layouts:
        world, tp, pp, cp = layout
        grid = RankGrid(world, tp=tp, pp=pp, cp=cp)
        for rank in range(world):
            got, exc = _call(fn, rank, layout_of(*layout), exercise="groups_of")
            if isinstance(exc, NotImplementedError):
                return not_attempted("groups_of")
            if exc is not None:
                _verdict_for_exception(f"groups_of({rank}, {layout_of(*layout)})", exc)
                return False
            if not isinstance(got, dict) or set(got) != set(AXES):
                keys = sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__
                print(f"✗ groups_of({rank}, {layout_of(*layout)}) returned {safe_repr(got)} ({keys})")
                print("  hint: return a dict with exactly the keys 'tp', 'cp', 'dp' and 'pp', each a list of "
                      "ranks, e.g. {'tp': [4, 5], 'cp': [5], 'dp': [5, 7], 'pp': [1, 5]}")
                return False
            want = grid.groups_of(rank, AXES)
            for axis in AXES:
                if whole_numbers(got[axis]) != want[axis]:
                    print("\n".join(_group_mistake(fn, got[axis], want[axis], rank, axis, layout)))
                    return False
    print(f"✓ groups_of gives Megatron's TP, CP, DP and PP groups of every rank of {len(layouts)} layouts (the "
          f"seed's and {DRAWN_GROUP_LAYOUTS} drawn for this run)")
    return True


# ---- Lab 01, exercise 3: coordinates -> rank ---------------------------------------------------------

def _alternatives(c, s):
    """Formulas students often write instead, name -> rank."""
    t, k, d, p = c["tp"], c["cp"], c["dp"], c["pp"]
    T, K, D, P = s["tp"], s["cp"], s["dp"], s["pp"]
    return {
        "pp fastest (the order reversed)": p + P * (d + D * (k + K * t)),
        "pp before dp (order tp-cp-pp-dp)": t + T * (k + K * (p + P * d)),
        "cp left out": t + T * (d + D * p),
        "dp before cp (order tp-dp-cp-pp)": t + T * (d + D * (k + K * p)),
        "sizes and ranks swapped in the strides": t * T + k * K + d * D + p * P,
    }


def _matching_formula(fn, sizes: tuple):
    """The name of the wrong formula that gives the student's rank for *every* coordinate of the layout
    (at one coordinate several agree), or None."""
    tp, cp, dp, pp = sizes
    coords = list(itertools.product(range(tp), range(cp), range(dp), range(pp)))
    theirs = [as_whole(_call(fn, *c, *sizes, exercise="rank_of")[0]) for c in coords]
    named = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    for name in _alternatives(dict(tp=0, cp=0, dp=0, pp=0), named):
        if all(_alternatives(dict(tp=t, cp=k, dp=d, pp=p), named)[name] == mine
               for (t, k, d, p), mine in zip(coords, theirs)):
            return name
    return None


@exercise("rank_of")
def check_rank_of(fn) -> bool:
    """``fn(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp)`` must return the
    global rank in Megatron's default order tp-cp-ep-dp-pp (tp fastest)."""
    layouts = [(2, 1, 2, 2), (2, 2, 1, 2), *drawn_grids(drawn_rng(), 4)]
    for tp, cp, dp, pp in layouts:
        grid = RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp)
        for t, k, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
            got, exc = _call(fn, t, k, d, p, tp, cp, dp, pp, exercise="rank_of")
            if isinstance(exc, NotImplementedError):
                return not_attempted("rank_of")
            if isinstance(exc, (_CourseCode, LibraryPatched)):
                _verdict_for_exception(f"rank_of({t}, {k}, {d}, {p}, ...)", exc)
                return False
            want = grid.rank_of(tp=t, cp=k, dp=d, pp=p)
            value = as_whole(got) if exc is None else None
            if exc is not None or value != want:
                what = f"raised {type(exc).__name__}: {exc}" if exc else f"returned {safe_repr(got)}"
                print(f"✗ rank_of(tp_rank={t}, cp_rank={k}, dp_rank={d}, pp_rank={p}) with tp={tp}, cp={cp}, "
                      f"dp={dp}, pp={pp} {what}")
                name = None if exc is not None else _matching_formula(fn, (tp, cp, dp, pp))
                if name:
                    print(f"  hint: your formula matches '{name}'. Megatron's order tp-cp-ep-dp-pp puts tp "
                          f"fastest: rank = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank))")
                else:
                    print("  hint: each axis' stride is the product of the sizes of the axes before it in the "
                          "order: tp 1, cp tp, dp tp·cp, pp tp·cp·dp")
                return False
    print(f"✓ rank_of matches Megatron's order for every coordinate of {len(layouts)} layouts (2 fixed, 4 drawn "
          f"for this run)")
    return True


def all_divisor_layouts(world: int):
    """Every (tp, pp, cp) whose product divides ``world`` (for the notebook's sweeps)."""
    for tp in divisors(world):
        for pp in divisors(data_parallel_size(world, tp)):
            for cp in divisors(data_parallel_size(world, tp, pp)):
                yield tp, pp, cp


# ---- Lab 05, exercise 1: DP and micro-batches of a layout --------------------------------------------


# (world, tp, pp, cp, micro, global): the seed's A-F with the CPU sweep's batch and the GPU batch,
# seed 000's 32-GPU layouts, seed 001's 128-GPU run.
LAYOUTS = ([(8, tp, pp, cp, 1, 16) for tp, pp, cp in SEED_SWEEP.values()]
           + [(8, tp, pp, cp, 4, 64) for tp, pp, cp in SEED_SWEEP.values()]
           + [(32, 16, 2, 1, 1, 32), (32, 4, 8, 1, 2, 64), (128, 4, 4, 1, 8, 256), (16, 2, 2, 2, 2, 16)])
# layouts Megatron refuses: (world, tp, pp, cp, micro, global, the rule)
BAD_LAYOUTS = [(8, 3, 1, 1, 1, 16, "world_size % (tp*pp*cp)"), (8, 2, 2, 4, 1, 16, "world_size % (tp*pp*cp)"),
               (8, 1, 1, 1, 1, 12, "global % (micro*dp)"), (8, 1, 4, 1, 4, 4, "global % (micro*dp)")]


def _microbatches_if(gbs, micro, replicas):
    """The micro-batch count a student gets who divides by ``replicas`` (a mistaken DP, maybe), or None."""
    try:
        return num_microbatches(gbs, micro, int(replicas)) if replicas == int(replicas) else None
    except (ValueError, OverflowError):
        return None


def _drawn_batch_layouts(rng, count: int) -> tuple[list, list]:
    """``count`` possible layouts ``(world, tp, pp, cp, micro, global)`` drawn for this run, and two that
    Megatron refuses (as in :data:`BAD_LAYOUTS`: tp·pp·cp does not divide the world; global % (micro·dp))."""
    good = []
    for tp, cp, dp, pp in drawn_grids(rng, count):
        micro = rng.randint(1, 4)
        good.append((tp * cp * dp * pp, tp, pp, cp, micro, micro * dp * rng.randint(1, 8)))
    (world, tp, pp, cp), = _drawn_impossible(rng, 1)
    tp2, cp2, dp2, pp2 = next(g for g in drawn_grids(rng, 20) if g[2] > 1)
    micro = rng.randint(1, 4)
    bad = [(world, tp, pp, cp, 1, 16, "world_size % (tp*pp*cp)"),
           (tp2 * cp2 * dp2 * pp2, tp2, pp2, cp2, micro, micro * (dp2 * rng.randint(1, 4) + rng.randint(1, dp2 - 1)),
            "global % (micro*dp)")]
    return good, bad


def _want(world, tp, pp, cp, micro, gbs):
    cfg = ParallelConfig(world_size=world, tp=tp, pp=pp, cp=cp, micro_batch_size=micro, global_batch_size=gbs)
    return cfg.dp, cfg.num_microbatches


@exercise("derive_layout")
def check_layout(fn) -> bool:
    """``fn(world_size, tp, pp, cp, micro_batch_size, global_batch_size) -> (dp, num_microbatches)``;
    raises ValueError when the layout is impossible."""
    if is_course_answer(fn):
        return False
    drawn, drawn_bad = _drawn_batch_layouts(drawn_rng(), 4)
    for case in LAYOUTS + drawn:
        got, err = checked_call(fn, *case, references=references_for("derive_layout"))
        if err == "todo":
            return not_attempted("derive_layout")
        world, tp, pp, cp, micro, gbs = case
        want = _want(*case)
        args = f"derive_layout(world_size={world}, tp={tp}, pp={pp}, cp={cp}, micro={micro}, global={gbs})"
        if err:
            possible = ("; this layout is possible (tp·pp·cp divides the world, micro·dp the global batch)"
                        if err.startswith("raised ") else "")
            print(f"✗ {args}: {err}{possible}")
            return False
        try:
            dp, m = got
        except Exception:  # noqa: BLE001 - not a pair
            print(f"✗ {args} returned {safe_repr(got)}: return a pair (dp, num_microbatches)")
            return False
        if (as_whole(dp), as_whole(m)) == want:
            continue
        print(f"✗ {args} returned {safe_repr(got)}")
        wdp, wm = want
        dp_n, m_n = as_real(dp)[0], as_real(m)[0]
        if dp_n is None or m_n is None:
            print(f"  hint: return two numbers; {as_real(dp)[1] or as_real(m)[1]}")
        elif dp_n != wdp:
            if cp > 1 and dp_n == data_parallel_size(world, tp, pp):
                print("  hint: CP ranks are not data-parallel replicas: DP = world / (TP * PP * CP)")
            elif dp_n in (data_parallel_size(world, tp=tp), data_parallel_size(world, pp=pp),  # splits forgotten
                          data_parallel_size(world, tp=tp, cp=cp), data_parallel_size(world, pp=pp, cp=cp)):
                print("  hint: DP is what is left after *every* model-parallel split: world / (TP * PP * CP)")
            else:
                print("  hint: DP is derived, never given: DP = world / (TP * PP * CP)")
        elif m_n != wm:
            if m_n == _microbatches_if(gbs, micro, 1):
                print("  hint: each DP replica takes global / DP samples: m = global / (micro * DP)")
            elif m_n == _microbatches_if(gbs, micro, world):
                print("  hint: divide by DP, not by the world size: TP/PP/CP ranks of one replica share its "
                      "micro-batches")
            elif m_n in (_microbatches_if(gbs, micro, dp_n * pp), _microbatches_if(gbs, micro, dp_n * tp)):
                print("  hint: TP and PP ranks of one replica all see the same micro-batches: divide by DP only")
            else:
                print("  hint: micro-batches per step m = global / (micro * DP)")
        return False
    for world, tp, pp, cp, micro, gbs, rule in BAD_LAYOUTS + drawn_bad:
        got, err = checked_call(fn, world, tp, pp, cp, micro, gbs, references=references_for("derive_layout"))
        if err == "todo":
            return not_attempted("derive_layout")
        if err and err.startswith(("raised ValueError", "raised UsageError")):
            continue
        print(f"✗ derive_layout(world_size={world}, tp={tp}, pp={pp}, cp={cp}, micro={micro}, global={gbs}) "
              f"{err if err else 'returned ' + safe_repr(got)}; Megatron refuses it: raise ValueError")
        print(f"  hint: check {rule} == 0 before dividing"
              + (" (a DP of 8 / 12 ranks is not a whole number of replicas)" if "tp" in rule else
                 " (every replica must get a whole number of micro-batches)"))
        return False
    print(f"✓ derive_layout: DP and micro-batches right on {len(LAYOUTS) + len(drawn)} layouts (A-F on CPU and GPU "
          f"batches, seeds 000/001, {len(drawn)} drawn for this run), {len(BAD_LAYOUTS) + len(drawn_bad)} impossible "
          f"ones refused")
    return True
