"""Judges for the notebooks of a test session, each forked from one clean server instead of started afresh.

A notebook's kernel starts its judge (:mod:`.judge_client`) as a fresh interpreter, which imports torch and the
checked process group before its first check: ~2.5 s of CPU per notebook on a 2-core machine, and ``make test``
runs 24 notebooks. Under pytest, the nbval plugin (:mod:`course_lib.classroom.notebooks.nbval_plugin`) starts
this server once per pytest process (:func:`start`): itself a fresh interpreter, started clean by pytest -- never
by a kernel -- which imports what a judge imports and then waits
(:func:`~course_lib.classroom.checks.judge.serve_forks`). A kernel started by that plugin finds the server's
address in its environment (:data:`ADDRESS_ENV`) and gets its judge as a fork of the server (:func:`fork_judge`):
the same :func:`~course_lib.classroom.checks.judge.serve` loop, its own session, the kernel's working directory and
environment, nothing of any kernel inherited, in ~0.1 s. A student's kernel has no such
address and starts its judge as before; so do the tests of the judge (``tests/classroom/test_judge.py``), which
run in pytest processes whose own environment never holds it.

The request is one ``SOCK_SEQPACKET`` message on a Unix socket: the judge's working directory and environment
(JSON) and the judge's ends of its four pipes (``SCM_RIGHTS``), as :func:`.judge_client._Client.start` would hand
them to ``Popen``; the answer is the judge's pid, watched from the kernel through a pidfd (it is not the
kernel's child). The judge ends as one started by ``Popen`` does: when the kernel closes its input, or by
``killpg`` (it leads its own session). The server ends with the pytest process that started it, and removes its
socket's folder even when that process was killed.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

from course_lib.launch.process_tree import PidfdProcess

ADDRESS_ENV = "COURSE_JUDGE_SERVER"
"""Where a kernel started under pytest finds the server (a Unix socket's path); set only in those kernels' env."""

_SERVER: dict = {}


def start() -> str | None:
    """Start this process's server once (later calls return the same address); its address, or None where the
    system has no pidfds or Unix packet sockets (not Linux): kernels then start judges of their own."""
    if "address" in _SERVER or not hasattr(os, "pidfd_open"):
        return _SERVER.get("address")
    folder = tempfile.mkdtemp(prefix="course-judges-")
    address = os.path.join(folder, "socket")
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(address)
        listener.listen(16)
    except (OSError, AttributeError):
        shutil.rmtree(folder, ignore_errors=True)
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", f"from course_lib.classroom.checks.judge import serve_forks; "
                                     f"serve_forks({listener.fileno()}, {os.getpid()})"],
        pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    listener.close()

    def stop() -> None:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    _SERVER.update(address=address, proc=proc)
    return address


class ServedJudge(PidfdProcess):
    """A judge forked by the server, as :class:`.judge_client._Client` uses a ``Popen``, with the kernel's ends of
    its pipes."""

    def __init__(self, pid: int, requests: int, stdout: int, stderr: int):
        super().__init__(pid)
        self.stdin = os.fdopen(requests, "wb")
        self.stdout, self.stderr = os.fdopen(stdout, "rb"), os.fdopen(stderr, "rb")


def fork_judge(address: str, env: dict, cwd: str) -> tuple[ServedJudge, int]:
    """A judge forked by the server at ``address`` for this kernel: the judge (a ``Popen``-like) and the read end
    of its reply pipe. OSError when the server cannot be reached."""
    pipes = [os.pipe() for _ in range(4)]  # requests, stdout, stderr, reply
    theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
    mine = [pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(30)
            conn.connect(address)
            socket.send_fds(conn, [json.dumps({"cwd": cwd, "env": env}).encode()], theirs)
            answer = conn.recv(4096)
        pid = json.loads(answer)["pid"] if answer else None
        if not isinstance(pid, int):
            raise OSError("the judge server gave no judge")
        judge = ServedJudge(pid, mine[0], mine[1], mine[2])
    except (OSError, ValueError, KeyError) as exc:
        for fd in mine:
            os.close(fd)
        raise OSError(f"no judge from the server at {address}: {exc}") from None
    finally:
        for fd in theirs:
            os.close(fd)
    return judge, mine[3]
