"""Lab 00's library: the six collectives' before/after, the reference ring all-reduce, and the checker."""

import torch
import torch.distributed as dist

from course_lib import collectives
from course_lib.checks.lab00 import check_ring_all_reduce
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


def _identity(x):
    return x


def _deadlock(x):
    r, w = dist.get_rank(), dist.get_world_size()
    dist.send(x, (r + 1) % w)
    dist.recv(x, (r - 1) % w)
    return x


def _cheat(x):
    dist.all_reduce(x)
    return x


def _todo(x):
    raise NotImplementedError


def test_checker_passes_the_reference_and_names_each_mistake(capsys):
    assert check_ring_all_reduce(collectives.ring_all_reduce) is True
    assert "✓" in capsys.readouterr().out
    assert check_ring_all_reduce(_identity) is False
    assert "add the chunk you receive" in capsys.readouterr().out
    assert check_ring_all_reduce(_deadlock, timeout=4) is False
    assert "deadlock" in capsys.readouterr().out
    assert check_ring_all_reduce(_cheat) is False
    assert "dist.all_reduce is not allowed" in capsys.readouterr().out
    assert check_ring_all_reduce(_todo) is False
    assert capsys.readouterr().out.startswith("not attempted yet")
