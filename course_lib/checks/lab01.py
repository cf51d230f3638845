"""Checkers for Lab 01's exercises (the rank grid).

* ``check_derive_dp(fn)``: ``fn(world_size, tp, pp, cp) -> dp`` (ValueError when impossible)
* ``check_rank5_groups(answer)``: the TP/PP/DP groups of rank 5 for 8 ranks, TP=2, PP=2
  (a dict, or a function returning it)
* ``check_rank_of(fn)``: ``fn(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp) -> rank`` in
  Megatron's default order tp-cp-ep-dp-pp

Each prints one verdict line (✓ / ✗, or "not attempted yet" when the exercise
still raises NotImplementedError) and, when wrong, the most specific hint it can
find. Expected values come from ``course_lib.topology.RankGrid``, which the tests
compare with Megatron-LM's own algorithm.
"""

from __future__ import annotations

import itertools

from course_lib.checks import not_attempted, try_student
from course_lib.topology import RankGrid, divisors


# ---- exercise 1: derive DP --------------------------------------------------------------

def check_derive_dp(fn) -> bool:
    """``fn(world_size, tp, pp, cp)`` must return world / (tp·pp·cp) and raise
    ValueError when tp·pp·cp does not divide the world size."""
    cases = [(8, 2, 2, 1), (8, 1, 1, 1), (8, 2, 2, 2), (128, 4, 4, 1), (32, 16, 2, 1), (32, 4, 8, 1),
             (96, 2, 3, 2), (8, 8, 1, 1)]
    for world, tp, pp, cp in cases:
        got, exc = try_student(fn, world, tp, pp, cp)
        if isinstance(exc, NotImplementedError):
            return not_attempted("derive_dp")
        want = world // (tp * pp * cp)
        if exc is not None:
            print(f"✗ derive_dp({world}, tp={tp}, pp={pp}, cp={cp}) raised {type(exc).__name__}: {exc}")
            return False
        if got != want or isinstance(got, bool):
            print(f"✗ derive_dp({world}, tp={tp}, pp={pp}, cp={cp}) returned {got!r}, expected {want}")
            if got == world // (tp * pp):
                print("  hint: context parallelism is a factor of the world size too: dp = world / (tp·pp·cp)")
            elif isinstance(got, float):
                print("  hint: return an int (use //, after checking divisibility)")
            elif got == tp * pp * cp:
                print("  hint: that is the model-parallel size tp·pp·cp; dp is what is left: world / (tp·pp·cp)")
            else:
                print("  hint: every rank belongs to exactly one (tp, cp, dp, pp) cell: world = tp·pp·cp·dp")
            return False
    for world, tp, pp, cp in [(8, 3, 1, 1), (12, 2, 4, 1), (8, 2, 2, 4)]:
        got, exc = try_student(fn, world, tp, pp, cp)
        if not isinstance(exc, ValueError):
            what = f"returned {got!r}" if exc is None else f"raised {type(exc).__name__}"
            print(f"✗ derive_dp({world}, tp={tp}, pp={pp}, cp={cp}) {what}; tp·pp·cp = {tp * pp * cp} does not "
                  f"divide {world}")
            print("  hint: raise ValueError naming the rule, e.g. "
                  f"'world_size={world} is not divisible by tp·pp·cp={tp * pp * cp}'")
            return False
        if "\n" in str(exc) or not str(exc):
            print("✗ the ValueError should be one line naming the rule and a fix")
            return False
    print(f"✓ derive_dp is right for {len(cases)} layouts and rejects the 3 impossible ones")
    return True


# ---- exercise 2: the groups of rank 5, by hand -------------------------------------------

def check_rank5_groups(answer: dict) -> bool:
    """``answer = {'tp': [...], 'pp': [...], 'dp': [...]}`` for rank 5 of 8 ranks, TP=2, PP=2
    (or a function returning that dict)."""
    if callable(answer):
        answer, exc = try_student(answer)
        if isinstance(exc, NotImplementedError):
            return not_attempted("rank5_groups")
        if exc is not None:
            print(f"✗ your function raised {type(exc).__name__}: {exc}")
            return False
    if answer is None:
        return not_attempted("rank5_groups")
    if not isinstance(answer, dict) or set(answer) != {"tp", "pp", "dp"}:
        print("✗ give a dict with exactly the keys 'tp', 'pp' and 'dp', e.g. {'tp': [4, 5], ...}")
        return False
    grid = RankGrid(8, tp=2, pp=2)
    want = grid.groups_of(5, ["tp", "pp", "dp"])
    hints = {
        "tp": "TP neighbours are consecutive ranks (tp varies fastest): rank 5's TP group is the block of 2 "
              "ranks that starts at a multiple of 2",
        "pp": "the PP group links the same (tp, dp) position in every stage; a stage holds world/pp = 4 "
              "ranks, so the partner is 4 ranks away",
        "dp": "DP partners share tp rank and stage; dp is the next axis after tp, so the stride is tp = 2",
    }
    ok = True
    for axis in ("tp", "pp", "dp"):
        got = answer[axis]
        try:
            got_list = [int(r) for r in got]
        except TypeError:
            got_list = None
        if got_list != want[axis]:
            ok = False
            if got_list is not None and sorted(got_list) == want[axis]:
                print(f"✗ {axis}: right ranks, wrong order: list them in group-rank order, {want[axis]}")
            else:
                print(f"✗ {axis}: {got!r} is not rank 5's {axis.upper()} group")
                print(f"  hint: {hints[axis]}")
                if got_list is not None and 5 not in got_list:
                    print("  (rank 5 must be in each of its own groups)")
    if ok:
        print(f"✓ rank 5: TP {want['tp']}, PP {want['pp']}, DP {want['dp']} — exactly Megatron's groups")
    return ok


# ---- exercise 3: coordinates -> rank ------------------------------------------------------

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


def check_rank_of(fn) -> bool:
    """``fn(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp)`` must return the
    global rank in Megatron's default order tp-cp-ep-dp-pp (tp fastest)."""
    layouts = [(2, 1, 2, 2), (2, 2, 1, 2), (4, 2, 2, 2), (2, 3, 2, 2), (1, 1, 8, 1), (8, 1, 1, 4)]
    checked = 0
    for tp, cp, dp, pp in layouts:
        grid = RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp)
        for t, k, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
            got, exc = try_student(fn, t, k, d, p, tp, cp, dp, pp)
            if isinstance(exc, NotImplementedError):
                return not_attempted("rank_of")
            want = grid.rank_of(tp=t, cp=k, dp=d, pp=p)
            if exc is not None or got != want:
                what = f"raised {type(exc).__name__}: {exc}" if exc else f"returned {got!r}"
                print(f"✗ rank_of(tp_rank={t}, cp_rank={k}, dp_rank={d}, pp_rank={p}) with tp={tp}, cp={cp}, "
                      f"dp={dp}, pp={pp} {what}; expected {want}")
                coords, sizes = {"tp": t, "cp": k, "dp": d, "pp": p}, {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
                for name, value in _alternatives(coords, sizes).items():
                    if exc is None and got == value:
                        print(f"  hint: your formula matches '{name}'. Megatron's order tp-cp-ep-dp-pp puts tp "
                              f"fastest: rank = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank))")
                        break
                else:
                    print("  hint: each axis' stride is the product of the sizes of the axes before it in the "
                          "order: tp 1, cp tp, dp tp·cp, pp tp·cp·dp")
                return False
            checked += 1
    print(f"✓ rank_of matches Megatron's order for {checked} coordinates in {len(layouts)} layouts")
    return True


def all_divisor_layouts(world: int):
    """Every (tp, pp, cp) whose product divides ``world`` (for the notebook's sweeps)."""
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in divisors(world // (tp * pp)):
                yield tp, pp, cp
