"""The launcher's contract (course_lib.launch), in both modes.

Module-level rank functions so that torchrun mode can import them.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from course_lib.launch import LaunchTimeout, RankError, launch
from course_lib.magics import torchrun_cell


def rank_sum(scale=1.0):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {dist.get_backend()}")
    return dict(rank=dist.get_rank(), world=dist.get_world_size(), total=t.item() * scale, pid=os.getpid())


def rank_crash(bad_rank=1):
    if dist.get_rank() == bad_rank:
        raise ZeroDivisionError(f"deliberate failure on rank {bad_rank}")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the healthy ranks block here until the launcher kills them
    return os.getpid()


def rank_hang(pid_dir, hung_rank=1):
    open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w").write(str(os.getpid()))
    if dist.get_rank() == hung_rank:
        time.sleep(600)
    return dist.get_rank()


def rank_chatty(lines=40):
    for i in range(lines):
        print(f"rank {dist.get_rank()} line {i}", flush=True)
        time.sleep(0.001)
    return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_fork_returns_results_in_rank_order(world_size):
    results = launch(rank_sum, world_size=world_size, output="none", scale=2.0)
    assert [r["rank"] for r in results] == list(range(world_size))
    expected = 2.0 * world_size * (world_size + 1) / 2
    assert all(r["total"] == expected and r["world"] == world_size for r in results)
    assert len({r["pid"] for r in results}) == world_size  # really separate processes
    assert not any(_alive(r["pid"]) for r in results)
    assert results.outputs[0].strip() == f"rank 0 of {world_size} on gloo"


def test_fork_crash_names_the_rank_with_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(rank_crash, world_size=4, timeout=30, output="none", bad_rank=2)
    err = info.value
    assert err.rank == 2 and err.exc_type == "ZeroDivisionError"
    assert "deliberate failure on rank 2" in err.traceback and "rank_crash" in err.traceback
    assert str(err).startswith("rank 2 failed: ZeroDivisionError")
    assert time.monotonic() - start < 30  # reported well before the process-group timeout


def test_fork_hang_raises_at_timeout_and_kills_every_rank(tmp_path):
    with pytest.raises(LaunchTimeout) as info:
        launch(rank_hang, world_size=3, timeout=3, output="none", pid_dir=str(tmp_path), hung_rank=1)
    assert info.value.unfinished == [1]
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def test_fork_output_is_captured_per_rank(capsys):
    results = launch(rank_chatty, world_size=3, output="all")
    for r in range(3):
        assert results.outputs[r].splitlines() == [f"rank {r} line {i}" for i in range(40)]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "[rank 0]" and printed[41] == "[rank 1]" and printed[82] == "[rank 2]"
    launch(rank_chatty, world_size=3, output="rank0", lines=2)
    assert capsys.readouterr().out.splitlines() == ["rank 0 line 0", "rank 0 line 1"]


def test_fork_runs_functions_defined_locally():
    offset = 5

    def local(k):
        return dist.get_rank() * k + offset

    assert launch(local, world_size=2, output="none", k=10) == [5, 15]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size=0 must be an integer >= 1"),
    (dict(world_size=2, launcher="mpirun"), "launcher='mpirun' is unknown"),
    (dict(world_size=2, backend="mpi"), "backend='mpi' is unknown"),
    (dict(world_size=2, output="some"), "output='some' is unknown"),
    (dict(world_size=2, timeout=0), "timeout=0 must be a positive number"),
])
def test_bad_arguments_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        launch(rank_sum, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has GPUs")
def test_nccl_without_gpus_is_refused():
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank"):
        launch(rank_sum, world_size=2, backend="nccl")


def test_torchrun_needs_an_importable_function():
    with pytest.raises(ValueError, match="torchrun starts fresh Python processes"):
        launch(lambda: 0, world_size=2, launcher="torchrun")


def test_torchrun_returns_results_and_reports_crashes():
    results = launch(rank_sum, world_size=2, launcher="torchrun", output="none", timeout=60)
    assert [r["total"] for r in results] == [3.0, 3.0]
    assert results.command == "torchrun --standalone --nproc-per-node=2 -m course_lib.torchrun_worker " + \
        results.command.split()[-1]
    with pytest.raises(RankError) as info:
        launch(rank_crash, world_size=2, launcher="torchrun", output="none", timeout=60, bad_rank=1)
    assert info.value.rank == 1 and "deliberate failure on rank 1" in info.value.traceback


def test_torchrun_hang_raises_at_timeout(tmp_path):
    with pytest.raises(LaunchTimeout) as info:
        launch(rank_hang, world_size=2, launcher="torchrun", timeout=6, output="none",
               pid_dir=str(tmp_path), hung_rank=0)
    assert info.value.unfinished == [0]
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


CELL = """
import torch, torch.distributed as dist
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}: {t.item():g}")
"""


def test_torchrun_cell_magic_prints_each_rank_under_a_header(capsys):
    torchrun_cell("--nproc-per-node 3", CELL)
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0]", "rank 0: 6", "[rank 1]", "rank 1: 6", "[rank 2]", "rank 2: 6"]
    torchrun_cell("-n 2 --rank0-only", CELL)
    assert capsys.readouterr().out.splitlines() == ["rank 0: 3"]


def test_torchrun_cell_magic_fails_when_a_rank_fails():
    with pytest.raises(RankError, match="rank 1 failed: KeyError"):
        torchrun_cell("-n 2", "import torch.distributed as dist\nif dist.get_rank() == 1: {}['missing']\n")
    with pytest.raises(ValueError, match="usage: %%torchrun"):
        torchrun_cell("--nproc-per-node many", CELL)
