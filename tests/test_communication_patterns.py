"""Lab 00's library: the six collectives' before/after and the reference ring all-reduce, and its old name
(the checkers are tested in tests/classroom/checks/test_lab00_checks.py)."""

import importlib.util
import warnings

import torch
import torch.distributed as dist

from course_lib import communication_patterns
from course_lib.launch import launch


def test_before_after_matches_the_definitions():
    w = 4
    table = communication_patterns.before_after(world_size=w)
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
    got = communication_patterns.ring_all_reduce(x, sent=sent)
    return (got - want).abs().max().item(), sum(sent)


def test_reference_ring_equals_all_reduce_and_sends_2_w_minus_1_over_w():
    for world in (2, 3, 4):
        for numel in (1, 7, 12):
            res = launch(_ring_vs_all_reduce, world_size=world, output="none", numel=numel)
            assert max(err for err, _ in res) < 1e-5
            if numel % world == 0:
                assert {n for _, n in res} == {2 * (world - 1) * numel // world}


def _run_module_afresh(name):
    """Execute module ``name``'s code in a new module object (``sys.modules`` untouched): what its import runs."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_old_name_imports_silently_and_holds_the_same_functions(capfd):
    """``course_lib.collectives`` (notebooks copied before the rename) re-exports every public name, prints nothing.
    Its code and the module it re-exports run again here, every warning an error (``python -W error``), instead of
    in a fresh interpreter (~2 s of CPU for its import of torch, which is not the course's code)."""
    import course_lib.collectives as old_name

    public = [n for n in vars(communication_patterns) if not n.startswith("_")]
    assert all(getattr(old_name, n) is getattr(communication_patterns, n) for n in public)
    assert "ring_all_reduce" in public and "before_after" in public
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        modules = [_run_module_afresh(n) for n in ("course_lib.communication_patterns", "course_lib.collectives")]
    assert all(hasattr(m, "ring_all_reduce") and hasattr(m, "before_after") for m in modules)
    assert capfd.readouterr() == ("", "")
