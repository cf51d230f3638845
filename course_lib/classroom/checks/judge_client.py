"""The kernel's side of the judge (:mod:`~course_lib.classroom.checks.judge`): start it, hand it a check, show
what it prints.

:func:`ask` sends the judge the checker's name, the exercise, and the checker's arguments as plain data
(:mod:`~course_lib.classroom.checks.plain`), the student's functions as their source
(:func:`~course_lib.classroom.checks.student_code.capture`); while the judge works, its stdout and stderr
(the checker's lines, the student's ``print`` output) are written to this kernel's as they come, and its
reply arrives on a pipe of its own. :func:`warm_up` starts the judge when the checkers are imported in a
notebook, so it imports torch while the student reads. Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import codecs
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import types

from course_lib.classroom.checks import judge_server, plain
from course_lib.classroom.checks.records import VERDICTS_FD_ENV, verdict_file

_INSIDE = {"judge": False}
_IN_JUDGE = "COURSE_IN_JUDGE"


def inside() -> bool:
    """True in the judge and the processes it forks (where checkers run as written). Never in a notebook's kernel:
    a cell that sets the judge's flag there still has its checkers asked of the judge."""
    return _INSIDE["judge"] and not _in_a_kernel()


USE_ENV = "COURSE_JUDGE"


def wanted() -> bool:
    """Whether a checker called here asks the judge: in a notebook's kernel, in ``grade``'s (attached to the
    run's judge), or where :data:`USE_ENV` is ``1``; a test of a checker's logic, in a plain Python process,
    runs it in-process."""
    return not inside() and (_CLIENT.attached or _in_a_kernel() or os.environ.get(USE_ENV) == "1")


def _in_a_kernel() -> bool:
    app = sys.modules.get("ipykernel.kernelapp")
    return app is not None and app.IPKernelApp.initialized()


class _Client:
    """The kernel's judge: started on first use, restarted if it died."""

    def __init__(self):
        self.proc = None
        self.reply = None
        self.count = 0
        self.attached = False

    def start(self) -> None:
        if os.environ.get(_IN_JUDGE):
            raise RuntimeError("a judge does not start judges: this process already runs in one")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        sink = verdict_file()  # the judge writes the grading records, to the file this kernel has open
        if sink is not None:
            env[VERDICTS_FD_ENV] = str(sink.fileno())
        env["PYTHONUNBUFFERED"] = "1"
        env[_IN_JUDGE] = "1"
        self.proc = None
        server = os.environ.get(judge_server.ADDRESS_ENV)
        if server and sink is None:  # a kernel that pytest's nbval plugin started: a fork of its clean server
            try:
                self.proc, self.reply = judge_server.fork_judge(server, env, os.getcwd())
            except OSError:
                pass  # the server is gone: a judge of our own, as a student's kernel starts it
        if self.proc is None:
            read_end, write_end = os.pipe()
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c",
                 f"from course_lib.classroom.checks.judge import serve; serve({write_end})"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(write_end,) if sink is None else (write_end, sink.fileno()),
                env=env, cwd=os.getcwd(), start_new_session=True)
            os.close(write_end)
            self.reply = read_end
        self.buffer = b""
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:   # end of input: the judge ends its loop and removes its temp folder
                self.proc.stdin.close()
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ask(self, request: dict, timeout: float) -> dict:
        if not self.alive():
            if self.attached:  # grade's judge is the run's; another would write no record
                return {"crash": "the judge of this run has ended"}
            self.start()
        self.count += 1
        request["id"] = self.count
        self.proc.stdin.write((json.dumps(request) + "\n").encode("utf-8"))
        self.proc.stdin.flush()
        return self._wait(request["id"], timeout)

    def _wait(self, wanted: int, timeout: float) -> dict:
        """Stream the judge's output to this kernel's stdout/stderr until the reply ``wanted`` arrives."""
        streams = {self.proc.stdout.fileno(): (sys.stdout, codecs.getincrementaldecoder("utf-8")("replace")),
                   self.proc.stderr.fileno(): (sys.stderr, codecs.getincrementaldecoder("utf-8")("replace"))}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in (*streams, self.reply):
                sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                events = sel.select(max(0.0, left)) if left > 0 else []
                if not events:
                    self.stop()
                    return {"crash": f"the judge gave no verdict within {timeout:.0f} s"}
                for key, _ in events:
                    chunk = os.read(key.fd, 1 << 16)
                    if key.fd in streams:
                        stream, decoder = streams[key.fd]
                        if chunk:
                            stream.write(decoder.decode(chunk))
                        continue
                    if not chunk:
                        self.stop()
                        return {"crash": "the judge stopped"}
                    self.buffer += chunk
                while b"\n" in self.buffer:
                    line, self.buffer = self.buffer.split(b"\n", 1)
                    message = json.loads(line)
                    if message.get("id") == wanted:
                        self._drain(streams)
                        return message

    @staticmethod
    def _drain(streams) -> None:
        with selectors.DefaultSelector() as sel:
            for fd in streams:
                sel.register(fd, selectors.EVENT_READ)
            while events := sel.select(0):
                for key, _ in events:
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        stream, decoder = streams[key.fd]
                        stream.write(decoder.decode(chunk))
                    else:
                        sel.unregister(key.fd)
        sys.stdout.flush()


class _Attached:
    """A judge this kernel did not start (``grade``'s sandbox forked it), as :class:`_Client` uses a ``Popen``."""

    def __init__(self, pid: int, requests: int, stdout: int, stderr: int):
        self.pid, self.returncode = pid, None
        self.stdin = os.fdopen(requests, "wb")
        self.stdout, self.stderr = os.fdopen(stdout, "rb"), os.fdopen(stderr, "rb")

    def poll(self):
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                done, status = self.pid, 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = time.monotonic() + (timeout if timeout is not None else 5.0)
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.returncode


_CLIENT = _Client()


def attach(pid: int, requests: int, stdout: int, stderr: int, reply: int) -> None:
    """Use the judge ``pid`` (its request pipe, its output pipes, its reply pipe): ``grade``'s sandbox forks one
    per run (:mod:`course_lib.classroom.grading.sandbox`); it is never restarted from here."""
    _CLIENT.proc, _CLIENT.reply, _CLIENT.buffer, _CLIENT.attached = _Attached(pid, requests, stdout, stderr), reply, \
        b"", True
RUNNING = {"cell": None}
"""The notebook cell running now, as ``grade``'s driver sets it (:mod:`course_lib.classroom.grading.driver`): the
judge writes it into its record, and the grader counts a verdict only from its exercise's checker cell."""


def warm_up() -> None:
    """Start the judge now, in a notebook's kernel (in the background: the notebook goes on while the judge
    imports torch); nothing elsewhere (a test, the judge itself)."""
    if wanted() and not os.environ.get(_IN_JUDGE) and not _CLIENT.alive():
        _CLIENT.start()


def _encode_arg(value):
    from course_lib.classroom.checks.student_code import CaptureError, capture

    if isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__":
        try:
            return {"$": "student", "captured": capture(value)}
        except (CaptureError, SyntaxError, OSError) as exc:
            return {"$": "student", "error": str(exc)}
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        try:
            return {"$": "student", "captured": capture(value)}
        except CaptureError:
            pass
    return plain.encode(value)


def ask(checker, args: tuple, kwargs: dict, timeout: float = 1800):
    """Run ``checker(*args, **kwargs)`` in the judge (which works out its exercise itself); its output appears
    here; returns its verdict (a dict: ``verdict`` as :meth:`Verdict.as_json`, or ``crash`` with what went
    wrong)."""
    request = {"checker": f"{checker.__module__}:{checker.__qualname__}",
               "args": [_encode_arg(a) for a in args], "kwargs": {k: _encode_arg(v) for k, v in kwargs.items()},
               "timeout": timeout, "cell": RUNNING["cell"]}
    return _CLIENT.ask(request, timeout + 60)
