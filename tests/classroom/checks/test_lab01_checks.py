"""Lab 01's checkers: a table of wrong answers (each with the hint it must get) and right answers
written differently (any integer type, tuples, arrays, tensors), which must pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import course_lib.topology as topology
from course_lib.classroom.checks.rank_grid import check_derive_dp, check_groups_of, check_rank_of
from course_lib.topology import ParallelConfig, RankGrid


def _coords(rank, layout):
    tp, cp, pp = layout["tp"], layout["cp"], layout["pp"]
    dp = layout["world_size"] // (tp * cp * pp)
    return (rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)), (tp, cp, dp, pp)


def _groups(rank, layout, at):
    """The four groups of ``rank`` when ``at(t, k, d, p, sizes)`` numbers the ranks."""
    (t, k, d, p), sizes = _coords(rank, layout)
    tp, cp, dp, pp = sizes
    if at is not _megatron:  # recover the coordinates under the student's own numbering
        (t, k, d, p) = next(c for c in np.ndindex(tp, cp, dp, pp) if at(*c, sizes) == rank)
    return {"tp": [at(i, k, d, p, sizes) for i in range(tp)], "cp": [at(t, i, d, p, sizes) for i in range(cp)],
            "dp": [at(t, k, i, p, sizes) for i in range(dp)], "pp": [at(t, k, d, i, sizes) for i in range(pp)]}


def _megatron(t, k, d, p, sizes):
    tp, cp, dp, pp = sizes
    return t + tp * (k + cp * (d + dp * p))


def _dp_before_cp(t, k, d, p, sizes):
    tp, cp, dp, pp = sizes
    return t + tp * (d + dp * (k + cp * p))


def _pp_fastest(t, k, d, p, sizes):
    tp, cp, dp, pp = sizes
    return p + pp * (d + dp * (k + cp * t))


def groups_right(rank, layout):
    return _groups(rank, layout, _megatron)


def groups_as_arrays_tuples_tensors(rank, layout):
    g = groups_right(rank, layout)
    return {"tp": np.array(g["tp"]), "cp": tuple(g["cp"]), "dp": torch.tensor(g["dp"]),
            "pp": [np.int64(r) for r in g["pp"]]}


def groups_dp_before_cp(rank, layout):
    return _groups(rank, layout, _dp_before_cp)


def groups_pp_fastest(rank, layout):
    return _groups(rank, layout, _pp_fastest)


def groups_descending(rank, layout):
    return {axis: ranks[::-1] for axis, ranks in groups_right(rank, layout).items()}


def groups_without_cp_key(rank, layout):
    g = groups_right(rank, layout)
    del g["cp"]
    return g


def groups_via_rankgrid(rank, layout):
    return RankGrid(layout["world_size"], tp=layout["tp"], pp=layout["pp"], cp=layout["cp"]).groups_of(
        rank, ["tp", "cp", "dp", "pp"])


def groups_patch_rankgrid(rank, layout):
    topology.RankGrid.groups_of = lambda self, r, tokens=None: {}
    return groups_right(rank, layout)


def groups_strings(rank, layout):
    return {axis: ",".join(map(str, ranks)) for axis, ranks in groups_right(rank, layout).items()}


def todo(*args):
    raise NotImplementedError


GROUPS_TABLE = [
    (groups_right, True, ["✓", "every rank of 7 layouts (the seed's and 4 drawn for this run)"]),
    (groups_as_arrays_tuples_tensors, True, ["✓"]),
    (groups_dp_before_cp, False, ["['cp'] = [0, 4] is not rank 0's CP group",
                                  "CP groups under order tp-dp-cp-pp (DP before CP)", "the stride is tp"]),
    (groups_pp_fastest, False, ["['tp'] = [0, 4] is not rank 0's TP group", "TP groups under PP fastest"]),
    (groups_descending, False, ["right ranks, wrong order"]),
    (groups_without_cp_key, False, ["exactly the keys 'tp', 'cp', 'dp' and 'pp'"]),
    (groups_via_rankgrid, False, ["course's own course_lib.topology.RankGrid", "write it yourself"]),
    (groups_patch_rankgrid, False, ["it replaced course_lib.topology.RankGrid.groups_of (undone"]),
    (groups_strings, False, ["a list of ints"]),
    (todo, False, ["not attempted yet: write groups_of"]),
]


@pytest.mark.parametrize("fn, passes, words", GROUPS_TABLE, ids=[row[0].__name__ for row in GROUPS_TABLE])
def test_groups_of_checker_table(fn, passes, words, capsys):
    groups_of = RankGrid.groups_of
    assert check_groups_of(fn).ok is passes
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out
    assert "expected" not in out, out  # a hint names the rule, never the answer
    assert RankGrid.groups_of is groups_of  # a patch never outlives the check


def dp_right(world, tp, pp, cp=1):
    if world % (tp * pp * cp):
        raise ValueError(f"world_size={world} is not divisible by tp·pp·cp={tp * pp * cp}")
    return world // (tp * pp * cp)


DP_TABLE = [
    (dp_right, True, ["✓"]),
    (lambda w, tp, pp, cp=1: np.int64(dp_right(w, tp, pp, cp)), True, ["✓"]),
    (lambda w, tp, pp, cp=1: float(dp_right(w, tp, pp, cp)), True, ["✓"]),
    (lambda w, tp, pp, cp=1: torch.tensor(dp_right(w, tp, pp, cp)), True, ["✓"]),
    (lambda w, tp, pp, cp=1: w // (tp * pp), False, ["context parallelism is a factor"]),
    (lambda w, tp, pp, cp=1: tp * pp * cp, False, ["model-parallel size tp·pp·cp"]),
    (lambda w, tp, pp, cp=1: float("nan"), False, ["NaN"]),
    (lambda w, tp, pp, cp=1: w / (tp * pp * cp), False, ["raise ValueError naming the rule"]),
    (lambda w, tp, pp, cp=1: ParallelConfig(w, tp=tp, pp=pp, cp=cp).dp, False,
     ["course's own course_lib.topology.ParallelConfig"]),
    (lambda w, tp, pp, cp=1: str(dp_right(w, tp, pp, cp)), False, ["string"]),
    (todo, False, ["not attempted yet: write derive_dp"]),
]


@pytest.mark.parametrize("fn, passes, words", DP_TABLE, ids=[str(i) for i in range(len(DP_TABLE))])
def test_derive_dp_checker_table(fn, passes, words, capsys):
    assert check_derive_dp(fn).ok is passes
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


def rank_right(t, k, d, p, tp, cp, dp, pp):
    return t + tp * (k + cp * (d + dp * p))


RANK_TABLE = [
    (rank_right, True, ["✓"]),
    (lambda *a: np.int32(rank_right(*a)), True, ["✓"]),
    (lambda t, k, d, p, tp, cp, dp, pp: t + tp * (d + dp * (k + cp * p)), False, ["dp before cp"]),
    (lambda t, k, d, p, tp, cp, dp, pp: p + pp * (d + dp * (k + cp * t)), False, ["pp fastest"]),
    (lambda t, k, d, p, tp, cp, dp, pp: RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(tp=t, cp=k, dp=d, pp=p),
     False, ["course's own course_lib.topology.RankGrid"]),
    (lambda *a: None, False, ["returned None"]),
]


@pytest.mark.parametrize("fn, passes, words", RANK_TABLE, ids=[str(i) for i in range(len(RANK_TABLE))])
def test_rank_of_checker_table(fn, passes, words, capsys):
    assert check_rank_of(fn).ok is passes
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


def test_a_table_of_the_fixed_cases_fails_on_the_drawn_ones(capsys):
    """Answers looked up for the checkers' fixed layouts fail on the layouts drawn per run, with a hint."""
    from course_lib.classroom.checks.rank_grid import GROUP_LAYOUTS

    groups = {(rank, layout): groups_right(rank, dict(world_size=layout[0], tp=layout[1], pp=layout[2], cp=layout[3]))
              for layout in GROUP_LAYOUTS for rank in range(layout[0])}
    key = lambda l: (l["world_size"], l["tp"], l["pp"], l["cp"])  # noqa: E731
    assert check_groups_of(lambda rank, layout: groups.get((rank, key(layout)), {})).ok is False
    assert "exactly the keys" in capsys.readouterr().out
    fixed = {(8, 2, 2, 1): 2, (8, 2, 2, 2): 1, (128, 4, 4, 1): 8}
    assert check_derive_dp(lambda w, tp, pp, cp=1: fixed.get((w, tp, pp, cp), 1)).ok is False
    assert "returned 1" in capsys.readouterr().out
    def fixed_ranks(t, k, d, p, tp, cp, dp, pp):
        return rank_right(t, k, d, p, tp, cp, dp, pp) if (tp, cp, dp, pp) in {(2, 1, 2, 2), (2, 2, 1, 2)} else 0

    assert check_rank_of(fixed_ranks).ok is False


def test_drawn_grids_vary_and_keep_two_split_axes():
    import random

    from course_lib.classroom.checks.rank_grid import _drawn_batch_layouts, _drawn_impossible, drawn_grids

    seen = set()
    for seed in range(200):
        rng = random.Random(seed)
        grids = drawn_grids(rng, 4)
        assert all(sum(n > 1 for n in g) >= 2 for g in grids)
        assert all(w % (tp * pp * cp) for w, tp, pp, cp in _drawn_impossible(rng, 3))
        good, bad = _drawn_batch_layouts(rng, 3)
        assert all(g % (m * w // (tp * pp * cp)) == 0 for w, tp, pp, cp, m, g in good)
        w, tp, pp, cp, m, g, _ = bad[1]
        assert w % (tp * pp * cp) == 0 and g % (m * w // (tp * pp * cp))
        seen.add(tuple(grids))
    assert len(seen) > 150
