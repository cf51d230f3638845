"""One-machine launches do not depend on this machine's hostname (gloo and torchrun meet on loopback);
a torchrun job that never gets past its rendezvous is stopped at its deadline with one line naming
that phase; a failing ``python -m course_lib train`` says its first failing rank's error once, and
torchrun's traceback goes to the log (course_lib/launch/contract.py, course_lib/launch/torchrun.py)."""

import re

import os
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from course_lib.classroom.grading.sandbox import namespaces_available
from course_lib.launch import torchrun
from course_lib.launch.contract import LaunchTimeout, bind_gloo_to_loopback
from course_lib.launch.process_tree import parent_pids

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> list[int]:
    parents, found, todo = parent_pids() or {}, [], [pid]
    while todo:
        here = todo.pop()
        kids = [p for p, parent in parents.items() if parent == here]
        found += kids
        todo += kids
    return found


def test_gloo_binds_to_loopback_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    bind_gloo_to_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")          # a person's choice stands
    bind_gloo_to_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_the_phase_is_named_in_the_timeout_line():
    start_up = LaunchTimeout(5, [1, 3], [""] * 4, "all 4 rank processes were stopped", phase="start-up", waited=15)
    assert str(start_up).startswith("ranks [1, 3] did not join the process group within 15s (start-up")
    run = LaunchTimeout(5, [0], [""] * 2)
    assert str(run).startswith("ranks [0] did not finish within timeout=5s (a hang or deadlock")


def test_a_rendezvous_timeout_says_when_localhost_does_not_resolve(monkeypatch):
    line = str(LaunchTimeout(5, [], [], phase="rendezvous", waited=65))
    assert line.startswith("torchrun's rendezvous did not complete within 65s: it started no rank (torchrun "
                           "--standalone meets at localhost: check that nothing blocks local TCP connections)"), line

    def unresolvable(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    line = str(LaunchTimeout(5, [], [], phase="rendezvous", waited=65))
    assert "meets at 'localhost', which does not resolve here: add '127.0.0.1 localhost' to /etc/hosts)" in line, line


def test_a_torchrun_rendezvous_that_never_completes_is_stopped_at_its_deadline(monkeypatch, capfd, tmp_path):
    # --nnodes=2 on one machine: torchrun's own rendezvous waits for a second node that never comes
    monkeypatch.setattr(torchrun, "_TORCHRUN_STARTUP_S", 0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    already_running = set(_descendants(os.getpid()))   # an earlier test in this xdist worker may hold a helper
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=2", "--nproc-per-node=1",
           "-m", "course_lib.train"]
    code = torchrun.run_torchrun(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=4)
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 124
    assert err[-1].startswith("error: torchrun's rendezvous did not complete within 4s: it started no rank"), err
    assert "torchrun and all its rank processes were stopped (the log: " in err[-1]
    assert [p.name for p in tmp_path.iterdir()] == [err[-1].rpartition(" ")[2].rstrip(")").rpartition("/")[2]]
    assert set(_descendants(os.getpid())) - already_running == set()


HUNG_RUN = """
import os, time
from course_lib.launch import init_rank
init_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "gloo", 60)
print("joined", flush=True)
if os.environ["RANK"] == "1":
    while True:                      # stuck outside any collective: no process-group timeout sees it
        time.sleep(1)
"""


def test_a_torchrun_run_that_hangs_is_stopped_at_its_deadline(monkeypatch, capfd, tmp_path):
    """``python -m course_lib train``'s run phase: rank 1 never ends (rank 0 has); the run deadline names it and
    stops every process."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "hung.py"
    script.write_text(HUNG_RUN)
    already_running = set(_descendants(os.getpid()))
    cmd = torchrun.torchrun_command(2, [str(script)])
    code = torchrun.run_torchrun(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                                 timeout=120, run_timeout=4)
    out, err = capfd.readouterr()
    assert code == 124 and out.count("joined") == 2, (out, err)
    assert err.strip().splitlines()[-1].startswith(
        "error: ranks [1] did not finish within timeout=4s (a hang or deadlock: check that every rank calls "
        "the same collectives in the same order); torchrun and all its rank processes were stopped (the log: "), err
    assert set(_descendants(os.getpid())) - already_running == set()
    assert sorted(p.name for p in tmp_path.iterdir())[1:] == ["hung.py"]      # the log, and the script


def _launch_under_a_hostname_that_does_not_resolve(report):
    """In a forked copy of this process: a UTS namespace of its own named ``no-such-host-for-the-course``,
    then a fork and a torchrun launch; what they did goes to ``report``, the process's stderr beside it."""
    import ctypes
    import socket
    import traceback

    from test_launch import rank_sum

    from course_lib.launch import launch

    clone_newuts = 0x04000000
    assert ctypes.CDLL(None, use_errno=True).unshare(clone_newuts) == 0, os.strerror(ctypes.get_errno())
    socket.sethostname("no-such-host-for-the-course")
    with open(f"{report}.stderr", "wb") as err:
        os.dup2(err.fileno(), 2)
    said = []
    try:
        for launcher in ("fork", "torchrun"):
            results = launch(rank_sum, world_size=2, launcher=launcher, timeout=60, output="none")
            assert [r["total"] for r in results] == [3.0, 3.0], results
            assert not any("resolve" in out for out in results.outputs), results.outputs
            said += [launcher, "ok"]
    except BaseException:
        said.append(traceback.format_exc())     # for the test's message
        raise
    finally:
        Path(report).write_text(" ".join(said))


@pytest.mark.slow
@pytest.mark.skipif(not namespaces_available(),
                    reason="needs CAP_SYS_ADMIN on Linux to give a process a hostname that does not resolve")
def test_a_hostname_that_does_not_resolve_changes_nothing(tmp_path, monkeypatch):
    import multiprocessing

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "launch"))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    report = tmp_path / "launches"
    child = multiprocessing.get_context("fork").Process(target=_launch_under_a_hostname_that_does_not_resolve,
                                                        args=(report,))
    child.start()
    child.join(240)
    stderr = Path(f"{report}.stderr").read_text() if Path(f"{report}.stderr").exists() else ""
    assert child.exitcode == 0, (report.read_text() if report.exists() else "", stderr)
    assert report.read_text().split() == ["fork", "ok", "torchrun", "ok"]
    assert "Unable to resolve" not in stderr


@pytest.mark.slow
def test_a_failing_run_says_its_error_once_and_keeps_the_traceback_in_the_log(tmp_path, monkeypatch, capfd):
    """--lr 1e30 on 2 ranks: the loss is NaN at iteration 2 on both; one line on the terminal, with the
    rank; torchrun's ChildFailedError traceback only in the log that line names. ``python -m course_lib
    train``'s main() runs in this process (what its interpreter would add is an import of torch)."""
    from course_lib.__main__ import main as course_main

    argv = ["--nproc-per-node", "2", "--uniform-vocab-padding", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e30", "--log-interval", "1"]
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    capfd.readouterr()
    code = course_main(["train", *argv])
    out, err = capfd.readouterr()
    assert code == 1, err
    line = re.fullmatch(r"error: rank [01]: lm_loss=nan at iteration 2 is not finite, .* "
                        r"\(the whole report, tracebacks included: (\S+)\)\n", err)
    assert line, err
    log = Path(line.group(1)).read_text()
    assert "ChildFailedError" in log and "Traceback" in log and "Traceback" not in out
    assert [p.name for p in tmp_path.iterdir()] == [Path(line.group(1)).name]   # the log, nothing else
