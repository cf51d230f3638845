"""The launcher's contract (course_lib.launch), in both modes.

Module-level rank functions so that torchrun mode can import them.
"""

import ctypes
import math
import os
import stat
import subprocess
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

from course_lib.launch import LaunchTimeout, RankError, RendezvousError, init_rank, launch
from course_lib.launch.magic import torchrun_cell


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


def rank_dies_first(how="exit3", dying_rank=1):
    """``dying_rank`` dies without a word while the others wait for it in a collective (and
    then fail: "Connection closed by peer"). A child of its own keeps the rank's pipes (not its
    sockets) open for a second, so a launcher that orders failures by when it *notices* them --
    the end of the pipe -- rather than by when they happened names a peer."""
    if dist.get_rank() == dying_rank:
        if os.fork() == 0:
            for fd in map(int, os.listdir("/proc/self/fd")):
                try:
                    if stat.S_ISSOCK(os.fstat(fd).st_mode):
                        os.close(fd)
                except OSError:
                    pass
            time.sleep(1)
            os._exit(0)
        if how == "exit3":
            os._exit(3)
        ctypes.string_at(0)  # SIGSEGV
    t = torch.zeros(1)
    dist.all_reduce(t)
    return dist.get_rank()


def rank_holds_the_gil(pid_dir, hung_rank=1):
    """``hung_rank`` sleeps in C holding the GIL: no Python thread (a watchdog) can run there."""
    open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w").write(str(os.getpid()))
    if dist.get_rank() == hung_rank:
        ctypes.PyDLL(None).sleep(60)
    return dist.get_rank()


def rank_starts_processes(pid_dir, failing_rank=None):
    """Start ``sleep 300`` twice -- a child, and a grandchild whose parent exits at once (a daemon,
    re-parented when its shell ends) -- record both pids, wait until every rank has, then return (or raise
    :func:`rank_crash`'s ZeroDivisionError on ``failing_rank``: the torchrun crash test reads that launch too)."""
    rank = dist.get_rank()
    child = subprocess.Popen(["sleep", "300"])
    daemon = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                            check=True).stdout.strip()
    with open(os.path.join(pid_dir, f"{rank}.pids"), "w") as f:
        f.write(f"{child.pid} {daemon}")
    dist.barrier()      # every rank has recorded its pids before one fails (else the launcher may stop a rank first)
    if rank == failing_rank:
        raise ZeroDivisionError(f"deliberate failure on rank {rank} after starting processes")
    return rank


def rank_sum_after_starting_processes(pid_dir):
    """:func:`rank_starts_processes`, then :func:`rank_sum`: one torchrun launch serves both tests."""
    rank_starts_processes(pid_dir)
    return rank_sum()


def left_running(pid_dir):
    """The processes ``rank_starts_processes`` started that still run a moment after the launch
    (ended here, so that a failing test leaves nothing either), and how many it started."""
    pids = [int(p) for f in sorted(pid_dir.glob("*.pids")) for p in f.read_text().split()]
    _all_gone(pids, within=2)
    survivors = [p for p in pids if _alive(p)]
    for p in survivors:
        os.kill(p, 9)
    return survivors, len(pids)


def _fail_to_load_here(child_pid):
    if os.getpid() != child_pid:
        raise ModuleNotFoundError("No module named 'only_on_the_rank'")
    return "loaded"


class LoadsOnlyOnTheRank:
    def __reduce__(self):
        return _fail_to_load_here, (os.getpid(),)


def rank_returns_unloadable(bad_rank=1):
    return LoadsOnlyOnTheRank() if dist.get_rank() == bad_rank else dist.get_rank()


def rank_launches_again():
    return launch(rank_sum, world_size=2, output="none")


def _alive(pid):
    """Whether ``pid`` runs (a zombie -- dead, not yet reaped by whoever adopted it -- does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _all_gone(pids, within=10):
    deadline = time.monotonic() + within
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_alive, pids))


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_fork_returns_results_in_rank_order(world_size):
    results = launch(rank_sum, world_size=world_size, output="none", scale=2.0)
    assert [r["rank"] for r in results] == list(range(world_size))
    expected = 2.0 * world_size * (world_size + 1) / 2
    assert all(r["total"] == expected and r["world"] == world_size for r in results)
    assert len({r["pid"] for r in results}) == world_size  # really separate processes
    assert not any(_alive(r["pid"]) for r in results)
    # backend="auto": NCCL (in the launcher's cpu:gloo,cuda:nccl group) when every rank has a GPU, else gloo
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "cpu:gloo,cuda:nccl" if gpus >= world_size else "gloo"
    assert results.outputs[0].strip() == f"rank 0 of {world_size} on {backend}"


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
    assert info.value.unfinished == [1] and "all 3 rank processes were stopped" in str(info.value)
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
    (dict(world_size=2, timeout=0), "timeout=0 must be in [1, 604800]"),
    (dict(world_size=2, timeout=math.nan), "timeout=nan must be in [1, 604800]"),
    (dict(world_size=2, timeout=math.inf), "timeout=inf must be in [1, 604800]"),
    (dict(world_size=2, timeout="60"), "timeout='60' must be in [1, 604800]"),
    (dict(world_size=2, timeout=True), "timeout=True must be in [1, 604800]"),
    (dict(world_size=2, timeout=1e12), "timeout=1000000000000.0 must be in [1, 604800]"),
    (dict(world_size=True), "world_size=True must be an integer >= 1"),
    (dict(world_size=2.0), "world_size=2.0 must be an integer >= 1"),
    (dict(world_size=2**70), "more processes than one machine runs (1024 at most)"),
    (dict(world_size=10**5), "more processes than one machine runs (1024 at most)"),
    (dict(world_size=2, timeout=0.001), "timeout=0.001 is shorter than a rendezvous takes"),
])
def test_bad_arguments_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        launch(rank_sum, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("how, death", [("exit3", "exited with code 3 without reporting a result"),
                                        ("sigsegv", "was killed by signal SIGSEGV")])
def test_fork_names_the_rank_that_died_first_with_its_exit(how, death):
    with pytest.raises(RankError) as info:
        launch(rank_dies_first, world_size=3, timeout=30, output="none", how=how)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ProcessDied"
    assert str(err).startswith(f"rank 1 {death}"), str(err)


def test_fork_result_that_cannot_be_unpickled_names_its_rank():
    with pytest.raises(RankError) as info:
        launch(rank_returns_unloadable, world_size=2, output="none")
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 returned a value that cannot be unpickled in the launching process: "
                                      "ModuleNotFoundError: No module named 'only_on_the_rank'")


@pytest.mark.parametrize("failing_rank", [None, 1])
def test_fork_leaves_no_process_a_rank_started(tmp_path, failing_rank):
    if failing_rank is None:
        assert launch(rank_starts_processes, world_size=2, output="none", pid_dir=str(tmp_path)) == [0, 1]
    else:
        with pytest.raises(RankError, match="deliberate failure on rank 1 after starting processes"):
            launch(rank_starts_processes, world_size=2, output="none", pid_dir=str(tmp_path), failing_rank=1)
    assert left_running(tmp_path) == ([], 4)


RENDEZVOUS_FIX = "every rank must reach the rendezvous in time: give a longer timeout"


def test_fork_a_rank_that_never_joins_is_one_line_naming_the_rank_that_waited(monkeypatch):
    """Rank 1 reaches the rendezvous 30 s late (the forked ranks inherit this patch): rank 0's
    own timeout (the launch's 2 s plus the start-up allowance, here 1 s) says so, in one line -- not a
    "hang or deadlock" or "start-up ran out" from the launcher's deadline, which comes later."""
    from course_lib.launch import fork

    monkeypatch.setattr(fork, "_FORK_STARTUP_S", 1)
    join = dist.init_process_group

    def late(*args, **kwargs):
        if kwargs["rank"] == 1:
            time.sleep(30)
        return join(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", late)
    with pytest.raises(RankError) as info:
        launch(rank_sum, world_size=2, timeout=2, output="none")
    err = info.value
    assert err.rank == 0 and err.exc_type == "RendezvousError", str(err)
    assert str(err).startswith("rank 0 could not join the process group within 3 s (DistStoreError: ")
    assert RENDEZVOUS_FIX in str(err) and "\n" not in str(err), str(err)


def test_an_env_rendezvous_that_cannot_reach_its_store_is_one_line(monkeypatch):
    """How a torchrun rank (and ``train``) joins: env://, here to a port where nothing listens."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(RendezvousError) as info:
        init_rank(1, 2, "gloo", timeout=1)
    message = str(info.value)
    assert message.startswith("rank 1 could not join the process group within 1 s (DistNetworkError: ")
    assert f"{port}" in message and RENDEZVOUS_FIX in message and "\n" not in message, message
    assert not dist.is_initialized()


def test_a_launch_inside_a_launch_is_refused_in_one_line():
    with pytest.raises(RankError) as info:
        launch(rank_launches_again, world_size=2, output="none")
    last_line = info.value.traceback.strip().splitlines()[-1]
    assert last_line.startswith("course_lib.launch.LaunchError: launch() was called on rank ")
    assert "nested launches are not supported" in last_line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has GPUs")
def test_nccl_without_gpus_is_refused():
    with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank"):
        launch(rank_sum, world_size=2, backend="nccl")


def test_torchrun_needs_an_importable_function():
    with pytest.raises(ValueError, match="torchrun starts fresh Python processes"):
        launch(lambda: 0, world_size=2, launcher="torchrun")


# ---- torchrun: every launch of this file's torchrun tests runs at once (a module fixture) ------------
#
# A torchrun launch costs seconds of start-up, most of it waiting (imports, rendezvous, timeouts), so
# the five launches below run concurrently, each in a thread of its own, and each test reads its
# launch's outcome. They share one temporary folder ($TMPDIR and tempfile's), checked empty once
# every launch has ended: no launch, clean, crashed, dead, hung or stopped by the backstop, leaves a
# job folder or a torchelastic_* file behind.

def _outcome(fn, **kwargs):
    """(return value or exception, monotonic time the launch ended)."""
    try:
        value = launch(fn, world_size=2, launcher="torchrun", output="none", **kwargs)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        value = exc
    return value, time.monotonic()


def _when_all_started(pid_dir, n, box):
    """Record (monotonic) when the ``n`` ranks of a launch have written their pid files (fn started)."""
    while len(list(pid_dir.glob("*.pid"))) < n and "stop" not in box:
        time.sleep(0.05)
    box["all_started"] = time.monotonic()


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    folder = tmp_path_factory.mktemp("torchrun")
    own_tmp = folder / "tmp"
    own_tmp.mkdir()
    pid_dirs = {name: folder / name for name in ("gil", "hang", "spawn", "spawn-crash")}
    for d in pid_dirs.values():
        d.mkdir()
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(own_tmp), str(own_tmp)
    started = {}
    watcher = threading.Thread(target=_when_all_started, args=(pid_dirs["gil"], 2, started), daemon=True)
    watcher.start()
    jobs = {
        "sigsegv": (rank_dies_first, dict(timeout=60, how="sigsegv")),
        "gil": (rank_holds_the_gil, dict(timeout=2, pid_dir=str(pid_dirs["gil"]), hung_rank=1)),
        "hang": (rank_hang, dict(timeout=3, pid_dir=str(pid_dirs["hang"]), hung_rank=0)),
        # the clean launch: the sum test's and the spawn test's (a torchrun launch is ~6 s of CPU)
        "spawn": (rank_sum_after_starting_processes, dict(timeout=60, pid_dir=str(pid_dirs["spawn"]))),
        # the crash test's and the failing spawn test's: rank 1 raises, rank 0 has returned (a healthy peer
        # blocked in a collective while another rank dies is the sigsegv launch)
        "spawn-crash": (rank_starts_processes, dict(timeout=60, pid_dir=str(pid_dirs["spawn-crash"]),
                                                    failing_rank=1)),
    }
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {name: pool.submit(_outcome, fn, **kw) for name, (fn, kw) in jobs.items()}
            runs = {name: f.result() for name, f in futures.items()}
    finally:
        started["stop"] = True
        os.environ.pop("TMPDIR", None)
        if saved[0] is not None:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
    runs["left_in_tmp"] = sorted(p.name for p in own_tmp.iterdir())
    runs["gil_started_at"] = started.get("all_started")
    runs["pid_dirs"] = pid_dirs
    return runs


def test_torchrun_returns_results_and_leaves_no_file(torchrun_runs):
    results, _ = torchrun_runs["spawn"]
    assert not isinstance(results, Exception), results
    assert [r["total"] for r in results] == [3.0, 3.0]
    assert results.command == "torchrun --standalone --nproc-per-node=2 -m course_lib.launch.worker"
    assert torchrun_runs["left_in_tmp"] == []  # no launch left its job folder or torch elastic's torchelastic_*


def test_torchrun_reports_crashes_with_the_traceback(torchrun_runs):
    err, _ = torchrun_runs["spawn-crash"]
    assert isinstance(err, RankError), err
    assert err.rank == 1 and err.exc_type == "ZeroDivisionError"
    assert "deliberate failure on rank 1" in err.traceback and "rank_starts_processes" in err.traceback


def test_torchrun_names_the_rank_that_died_not_the_peer_it_broke(torchrun_runs):
    err, _ = torchrun_runs["sigsegv"]
    assert isinstance(err, RankError), err
    assert err.rank == 1 and err.exc_type == "ProcessDied"
    assert str(err).startswith("rank 1 was killed by signal SIGSEGV"), str(err)


def test_torchrun_backstop_stops_a_rank_whose_watchdog_cannot_run(torchrun_runs):
    err, ended = torchrun_runs["gil"]
    assert isinstance(err, LaunchTimeout), err
    assert err.unfinished == [1]
    assert "torchrun and all its rank processes were stopped" in str(err)
    pids = [int(p.read_text()) for p in torchrun_runs["pid_dirs"]["gil"].glob("*.pid")]
    assert len(pids) == 2 and _all_gone(pids)
    # stopped at timeout (2 s) + the watchdogs' grace (3 s) after both ranks started fn, not after the
    # 60 s allowed for start-up (timed from the start of fn: the launches start up concurrently)
    started = torchrun_runs["gil_started_at"]
    assert started is not None and ended - started < 2 + 3 + 10, ended - started


def test_torchrun_hang_raises_at_timeout(torchrun_runs):
    err, _ = torchrun_runs["hang"]
    assert isinstance(err, LaunchTimeout), err
    assert err.unfinished == [0] and "torchrun and all its rank processes were stopped" in str(err)
    pids = [int(p.read_text()) for p in torchrun_runs["pid_dirs"]["hang"].glob("*.pid")]
    assert len(pids) == 2 and _all_gone(pids)
    assert torchrun_runs["left_in_tmp"] == []  # stopped, torchrun's files are gone too


@pytest.mark.parametrize("name", ["spawn", "spawn-crash"])
def test_torchrun_leaves_no_process_a_rank_started(torchrun_runs, name):
    """Whether the launch succeeds or a rank raises, what a rank started (a child, a daemon) is gone
    when launch() returns: their parents ended before the launcher stopped the tree."""
    value, _ = torchrun_runs[name]
    if name == "spawn":
        assert not isinstance(value, Exception) and [r["rank"] for r in value] == [0, 1], value
    else:
        assert isinstance(value, RankError) and value.rank == 1, value
    assert left_running(torchrun_runs["pid_dirs"][name]) == ([], 4)


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


def test_torchrun_cell_magic_sys_exit_0_is_a_success_and_other_codes_fail():
    torchrun_cell("-n 3", "import sys, torch.distributed as dist\n"
                          "if dist.get_rank() == 0: sys.exit(0)\n"
                          "if dist.get_rank() == 1: sys.exit(None)\n"
                          "sys.exit()\n")
    with pytest.raises(RankError, match=r"rank 1 failed: RuntimeError: the cell called sys.exit\(3\)"):
        torchrun_cell("-n 2", "import sys, torch.distributed as dist\nif dist.get_rank() == 1: sys.exit(3)\n")
