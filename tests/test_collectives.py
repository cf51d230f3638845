"""Lab 00's library: the six collectives' before/after and the reference ring all-reduce
(the checkers are tested in tests/classroom/checks/test_lab00_checks.py)."""

import torch
import torch.distributed as dist

from course_lib import collectives
from course_lib.launch import launch


def test_before_after_matches_the_definitions():
    w = 4
    table = collectives.before_after(world_size=w)
    before = [[10 * r + i for i in range(w)] for r in range(w)]
    column_sums = [sum(before[r][i] for r in range(w)) for i in range(w)]
    assert table["all_reduce"]["after"] == [column_sums] * w
    assert table["all_gather"]["before"] == [[10 * r] for r in range(w)]
    assert table["all_gather"]["after"] == [[10 * r for r in range(w)]] * w
    assert table["reduce_scatter"]["after"] == [[column_sums[r]] for r in range(w)]
    assert table["broadcast"]["after"] == [before[0]] * w
    assert table["send_recv"]["after"] == [before[(r - 1) % w] for r in range(w)]
    assert table["all_to_all"]["after"] == [[before[j][r] for j in range(w)] for r in range(w)]


def _ring_vs_all_reduce(numel):
    torch.manual_seed(dist.get_rank())
    x = torch.randn(numel)
    want = x.clone()
    dist.all_reduce(want)
    sent = []
    got = collectives.ring_all_reduce(x, sent=sent)
    return (got - want).abs().max().item(), sum(sent)


def test_reference_ring_equals_all_reduce_and_sends_2_w_minus_1_over_w():
    for world in (2, 3, 4):
        for numel in (1, 7, 12):
            res = launch(_ring_vs_all_reduce, world_size=world, output="none", numel=numel)
            assert max(err for err, _ in res) < 1e-5
            if numel % world == 0:
                assert {n for _, n in res} == {2 * (world - 1) * numel // world}
