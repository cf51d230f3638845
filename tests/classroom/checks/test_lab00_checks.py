"""Lab 00's checkers: each wrong answer gets its own hint, right answers written differently pass.

The tables run the checkers end to end on real ranks (one launch per world size); the wrong
sums of buggy rings are also judged without processes (:func:`ring_problems` over simulated
rings), which covers every bug on 2, 3 and 4 ranks in a fraction of a second.
"""

from __future__ import annotations

import pytest
import torch

import lab00_answers as answers
from course_lib.classroom.checks import collectives
from course_lib.classroom.checks.collectives import (NUMELS, RING_BUGS, WORLD_SIZES, check_all_reduce_from_halves,
                                                     check_ring_all_reduce, ring_problems, simulate_ring)
from course_lib.classroom.checks.grad_sync import check_grad_sync, drawn_buckets, expected_buckets

# Other routes to a collective (a name bound earlier, gather + scatter, new groups...) are refused by
# the same process group: tests/classroom/checks/test_verdicts.py tries them all in one launch.
RING_TABLE = [
    # (answer, passes, words the verdict must contain)
    ("right_ring", True, ["✓", "2(W-1)/W·N elements per rank"]),
    ("ring_to_the_left", True, ["✓"]),
    ("whole_tensor_ring", False, ["not a ring", "elements: whole tensors"]),
    ("star_via_p2p", False, ["not a ring", "rank 0 sent to ranks [1, 2]"]),
    ("via_c10d", False, ["ran a collective: an all_reduce ran on the process group", "however they are reached"]),
    ("via_object_collective", False, ["an all_gather ran on the process group"]),
    ("via_course", False, ["course's own course_lib.communication_patterns.ring_all_reduce", "write it yourself"]),
    ("via_old_name", False, ["course's own course_lib.communication_patterns.ring_all_reduce", "write it yourself"]),
    ("todo", False, ["not attempted yet: write my_ring_all_reduce"]),
    ("returns_list", False, ["return the reduced tensor (got list)"]),
    ("ring_ag_adds", False, ["the reduce-scatter phase is right", "*replace* your chunk"]),
    ("ring_wrong_slot", False, ["killed by signal SIGABRT", "receive buffer of another size"]),
]


@pytest.mark.parametrize("name, passes, words", RING_TABLE, ids=[row[0] for row in RING_TABLE])
def test_ring_checker_table(name, passes, words, capsys):
    assert check_ring_all_reduce(getattr(answers, name)).ok is passes
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


def test_a_deadlocked_ring_is_named_a_deadlock(capsys):
    assert check_ring_all_reduce(answers.deadlock, timeout=3).ok is False
    assert "a deadlock" in capsys.readouterr().out


def _simulated_runs(spec: dict) -> dict:
    """What the checker would collect from a ring with bug ``spec`` (simulated, no processes)."""
    runs = {}
    for world in WORLD_SIZES:
        trials_by_numel = []
        for numel in NUMELS:
            xs = [torch.randint(-9, 10, (numel,), generator=torch.Generator().manual_seed(1000 * numel + r)).float()
                  for r in range(world)]
            want = sum(xs)
            got = simulate_ring(xs, **collectives._bug_steps(spec, world))
            trials_by_numel.append([dict(x=x, want=want, got=g, numel=numel, events=[]) for x, g in zip(xs, got)])
        runs[world] = [[trials_by_numel[i][r] for i in range(len(NUMELS))] for r in range(world)]
    return runs


BUG_HINTS = {
    # each all-gather-phase bug is told about the all-gather phase, never to fix its reduce-scatter
    "all-gather adds": ["reduce-scatter phase is right", "*replace* your chunk"],
    "no all-gather": ["add the all-gather phase"],
    "all-gather one step short": ["the all-gather phase needs W-1 steps"],
    "all-gather sends the wrong chunk": ["reduce-scatter phase is right", "send chunk (r + 1 - s) % W"],
    "reduce-scatter one step short": ["reduce-scatter phase needs W-1 steps"],
    "reduce-scatter replaces": ["*add* the incoming chunk"],
}


@pytest.mark.parametrize("bug", list(RING_BUGS))
def test_each_simulated_ring_bug_gets_its_own_hint(bug):
    lines = ring_problems(_simulated_runs(RING_BUGS[bug][0]))
    assert lines and lines[0].startswith("✗ wrong with 2 ranks")
    for word in BUG_HINTS[bug]:
        assert word in lines[1], lines


HALVES_TABLE = [
    ("rs_ag", True, ["✓", "exactly one reduce-scatter and one all-gather"]),
    ("rs_ag_single", True, ["✓"]),
    ("rs_ag_uses_all_reduce", False, ["1 all_reduce on world", "no all_reduce"]),
    ("gather_everything", False, ["the sum is right", "summed locally"]),
    ("rs_only", False, ["reduce-scattered shard"]),
    ("rs_ag_of_input", False, ["own input chunk"]),
    ("rs_ag_avg", False, ["W times too small"]),
    ("todo", False, ["not attempted yet: write my_all_reduce_rs_ag"]),
]


@pytest.mark.parametrize("name, passes, words", HALVES_TABLE, ids=[row[0] for row in HALVES_TABLE])
def test_all_reduce_from_halves_checker_table(name, passes, words, capsys):
    assert check_all_reduce_from_halves(getattr(answers, name)).ok is passes
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


SYNC_TABLE = [
    ("right_sync", True, ["✓", "three bucket_numel values drawn for this run"]),
    ("sync_with_avg", True, ["✓"]),
    ("sync_nothing", False, ["still this rank's own"]),
    ("sync_no_divide", False, ["W times too large"]),
    ("sync_per_param", False, ["4 all_reduce on world (3 + 24 + 8 + 48 elements)", "one all-reduce per parameter"]),
    ("sync_one_bucket", False, ["one all-reduce of everything"]),
    ("sync_forward_order", False, ["fill them in reverse"]),
    ("sync_full_bucket_split", False, ["would fill the current one to exactly bucket_numel: it still fits",
                                       "a bucket holds at most bucket_numel elements (<=)"]),
    ("sync_broadcast_rank0", False, ["differ from the single-process baseline"]),
    ("sync_via_course", False, ["course's own course_lib.training.finalize_model_grads.allreduce_dp_grads"]),
]


@pytest.mark.parametrize("name, passes, words", SYNC_TABLE, ids=[row[0] for row in SYNC_TABLE])
def test_grad_sync_checker_table(name, passes, words, capsys):
    assert check_grad_sync(getattr(answers, name)).ok is passes
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


def test_buckets_are_filled_in_reverse_parameter_order():
    assert expected_buckets([48, 8, 24, 3], 40) == [35, 48]
    assert expected_buckets([48, 8, 24, 3], 1000) == [83]
    assert expected_buckets([48, 8, 24, 3], 8) == [3, 24, 8, 48]


def test_drawn_cases_keep_their_kind_and_vary():
    """Every draw of the checkers' sizes is of the kinds the hints tell apart (several buckets, forward order
    different from reverse, one bucket, one per tensor; sizes W divides and does not), and draws differ."""
    import random

    sizes = [48, 8, 24, 3]
    draws = set()
    for seed in range(300):
        several, one, per_tensor = drawn_buckets(random.Random(seed))
        assert 1 < len(expected_buckets(sizes, several)) < 4
        assert expected_buckets(sizes, several) != expected_buckets(sizes[::-1], several)
        assert expected_buckets(sizes, one) == [83] and expected_buckets(sizes, per_tensor) == sizes[::-1]
        a, b, odd, few = collectives.drawn_numels(random.Random(seed))
        assert a % 12 == b % 12 == 0 and all(odd % w for w in WORLD_SIZES) and few < max(WORLD_SIZES)
        assert all(n % 4 == 0 for n in collectives.drawn_halves_numels(random.Random(seed)))
        draws.add((several, a, b, odd))
    assert len(draws) > 100


def test_every_draw_has_a_bucket_the_gradients_fill_exactly():
    """An answer off by one (a new bucket when the next gradient would *fill* the bucket: ``<`` for ``<=``)
    differs from the rule only where the gradients, in reverse order, add up to exactly bucket_numel: every run's
    draw has such a size, and there the off-by-one buckets differ from the right ones."""
    import itertools
    import random

    sizes = [48, 8, 24, 3]
    fills = set(itertools.accumulate(sizes[::-1]))
    for seed in range(8):
        drawn = drawn_buckets(random.Random(seed))
        on = [b for b in drawn if b in fills]
        assert on, (seed, drawn)
        assert all(expected_buckets(sizes, b - 1) != expected_buckets(sizes, b) for b in on), (seed, on)


# Right numbers without the exchange: rebuilt from the seeds the checker once drew its inputs from. Every
# rank now draws its own from os.urandom, so only the real exchange gives the sum.
REBUILT = [
    (check_ring_all_reduce, "ring_rebuilt_from_seeds", "wrong with 2 ranks"),
    (check_all_reduce_from_halves, "rs_ag_rebuilt_from_seeds", "wrong with 2 ranks"),
    (check_grad_sync, "sync_rebuilt_from_batch", "differ from the single-process baseline"),
    (check_grad_sync, "sync_own_grads_twice", "did not carry its own gradients"),
]


@pytest.mark.parametrize("checker, name, words", REBUILT, ids=[row[1] for row in REBUILT])
def test_right_numbers_without_the_exchange_are_refused(checker, name, words, capsys):
    assert checker(getattr(answers, name)).ok is False
    out = capsys.readouterr().out
    assert words in out and "✓" not in out, out
