"""The judge server of a test session (:mod:`course_lib.classroom.checks.judge_server`): a kernel that finds its
address gets a judge forked from it, which judges as a judge started afresh does (a right answer passes, the
course's own code is refused), ends when the kernel closes its input, and the server ends with the process that
started it."""

from __future__ import annotations

import linecache
import os
import signal
import subprocess
import sys
import time

from course_lib.classroom.checks import judge_client, judge_server
from course_lib.classroom.checks.rank_grid import check_rank_of


def _cell(source: str, name: str):
    filename = f"/tmp/ipykernel_0/served-{name}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    space = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), space)  # noqa: S102 - the test's own cell
    return space["rank_of"]


RIGHT = '''
def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
'''
COURSES_OWN = '''
from course_lib.topology.grid import RankGrid

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    return RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)
'''


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` has ended (a zombie waiting for whoever adopted it has ended too)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_served_judge_judges_as_a_fresh_one_and_ends_with_its_input(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_JUDGE", "1")
    monkeypatch.setenv(judge_server.ADDRESS_ENV, judge_server.start() or "")
    client = judge_client._Client()
    monkeypatch.setattr(judge_client, "_CLIENT", client)
    assert check_rank_of(_cell(RIGHT, "right")).ok
    assert isinstance(client.proc, judge_server.ServedJudge)
    judge = client.proc.pid
    assert os.getsid(judge) == judge  # its own session, as Popen(start_new_session=True): killpg reaches its checks
    verdict = check_rank_of(_cell(COURSES_OWN, "courses_own"))
    assert not verdict.ok and "RankGrid" in verdict.hint, verdict.hint
    assert client.proc.pid == judge  # one judge per kernel
    client.stop()
    assert _gone(judge)
    assert "✓ rank_of" in capsys.readouterr().out  # the judge's output reached this process's


def test_an_unreachable_server_leaves_the_kernel_a_judge_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_JUDGE", "1")
    monkeypatch.setenv(judge_server.ADDRESS_ENV, str(tmp_path / "no-server"))
    client = judge_client._Client()
    monkeypatch.setattr(judge_client, "_CLIENT", client)
    assert check_rank_of(_cell(RIGHT, "fallback")).ok
    assert isinstance(client.proc, subprocess.Popen)
    client.stop()


def test_the_server_ends_with_the_process_that_started_it_and_leaves_no_file():
    starter = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\n"
                               "from course_lib.classroom.checks import judge_server\n"
                               "judge_server.start()\n"
                               "print(judge_server._SERVER['proc'].pid, judge_server._SERVER['address'], flush=True)\n"
                               "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    pid, address = starter.stdout.readline().split()
    server = int(pid)
    assert os.path.exists(f"/proc/{server}")
    starter.send_signal(signal.SIGKILL)  # no atexit: the server's parent-death signal ends it
    starter.wait()
    assert _gone(server)
    assert not os.path.exists(os.path.dirname(address))  # nothing left in the temporary folder
