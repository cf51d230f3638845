"""Kernels for the notebooks of a test session, each forked from one clean zygote instead of started afresh.

A notebook's kernel is ``python -m ipykernel_launcher -f CONNECTION_FILE``, a fresh interpreter that imports
ipykernel and, in the lab's first cell, torch: ~2.9 s of CPU before the lab does anything (measured here: a
kernel that runs ``pass`` 0.63 s, ``import torch`` 2.36 s, with matplotlib and the course's launcher 2.86 s), and
``make test`` starts 24 of them. Under pytest the nbval plugin (:mod:`.nbval_plugin`) asks this module for each
kernel (:func:`fork_kernel`): one zygote per pytest process (:func:`_start`: itself a fresh interpreter,
started clean by pytest, never by a kernel) imports :data:`PRELOAD` and waits; each kernel is a fork of it that
takes the kernel's command line, environment, working directory and standard output and error, leads a session
of its own (as jupyter_client's ``Popen(start_new_session=True)``) and runs ipykernel's launcher as the command
would. What a fresh kernel would see differently is set back in the fork: ``TMPDIR`` (``tempfile``'s cached
folder), the random module's seed, ``sys.argv`` and ``sys.path``, the zygote's signal dispositions, exit
handlers. A module the zygote imported does not print its import-time warnings again in the notebook, so the
zygote imports only modules that print none (torch, numpy, ipykernel), and no matplotlib (its backend is chosen
from the kernel's environment).

The kernel is not pytest's child: the ``Popen`` jupyter_client's provisioner holds is a
:class:`~course_lib.launch.process_tree.PidfdProcess`, watching the kernel through a pidfd (its exit status is not
seen: 0). It ends as a ``Popen``'d kernel does (nbval kills its process group; ipykernel's parent poller, told the
zygote is its parent, ends it when the zygote is gone), and the zygote ends with the pytest process that started it.
Where the command is not a plain ipykernel of this interpreter (another kernel spec's Python is not this one, even
where it links to the same binary), or the zygote cannot be had (no pidfds: not Linux), the kernel is started as
before.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading

from course_lib.launch.process_tree import PidfdProcess

PRELOAD = ("torch", "numpy", "ipykernel.kernelapp")
"""What the zygote imports before it forks: what every lab's kernel imports, none printing at import."""
WAIT_S = 120.0
"""How long a kernel's start waits for the zygote's answer (its first one comes after its imports: seconds, more on
a loaded machine); a kernel of its own would import the same."""

_ZYGOTE: dict = {}
_LOCK = threading.Lock()


def fork_kernel(cmd: list[str], kwargs: dict) -> PidfdProcess | None:
    """The kernel ``cmd`` (jupyter_client's command line) with the launch's ``kwargs`` (``env``, ``cwd``) would
    start, forked from this process's zygote; None where the command is not a plain ipykernel of this interpreter
    or the zygote cannot be had -- the caller then starts the kernel as before."""
    outputs = [_fd(kwargs.get("stdout"), 1), _fd(kwargs.get("stderr"), 2)]  # where a Popen'd kernel's would go
    if cmd[1:3] != ["-m", "ipykernel_launcher"] or os.path.abspath(cmd[0]) != os.path.abspath(sys.executable) \
            or None in outputs or kwargs.get("stdin") is not None \
            or set(kwargs) - {"env", "cwd", "stdin", "stdout", "stderr"}:
        return None
    request = json.dumps({"argv": cmd[3:], "env": dict(kwargs.get("env") or os.environ),
                          "cwd": str(kwargs.get("cwd") or os.getcwd())}).encode()
    with _LOCK:
        conn = _start()
        if conn is None:
            return None
        try:
            socket.send_fds(conn, [request], outputs)
            answer = json.loads(conn.recv(4096) or b"{}")
            return PidfdProcess(answer["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            # gone, broken or too slow: this kernel and the next are started as before, and the zygote is stopped,
            # so that no fork of this request comes later (a second kernel on this connection file's sockets)
            _ZYGOTE.pop("conn", None)
            conn.close()
            _ZYGOTE["proc"].kill()
            return None


def _fd(target, inherited: int) -> int | None:
    """The descriptor a ``Popen`` argument ``stdout``/``stderr`` names (None: this process's own), or None for a
    pipe or anything else a fork cannot be handed."""
    if target is None:
        return inherited
    if isinstance(target, int):
        return target if target >= 0 else None
    try:
        return target.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _start() -> socket.socket | None:
    """This process's end of its zygote's socket, the zygote started the first time; None without pidfds."""
    if "conn" in _ZYGOTE or "tried" in _ZYGOTE:
        return _ZYGOTE.get("conn")
    _ZYGOTE["tried"] = True
    if not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return None
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from course_lib.classroom.notebooks.kernel_zygote import serve; "
                               f"serve({theirs.fileno()}, {os.getpid()})"],
        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
    theirs.close()
    mine.settimeout(WAIT_S)

    def stop() -> None:
        proc.kill()
        proc.wait()

    atexit.register(stop)
    _ZYGOTE.update(conn=mine, proc=proc)
    return mine


def serve(fd: int, parent: int) -> None:
    """The zygote's loop (its own interpreter, started by :func:`_start`): import :data:`PRELOAD`, then fork a
    kernel per request until the pytest process that started it ends."""
    import importlib

    from course_lib.launch.process_tree import die_with_parent, freeze_inherited_objects

    conn = socket.socket(fileno=fd)
    die_with_parent(parent, signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernels are reaped by no one: none stays a zombie here
    for module in PRELOAD:
        importlib.import_module(module)
    freeze_inherited_objects()
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        except OSError:
            os._exit(0)
        if not message:
            os._exit(0)  # pytest's end closed the socket
        try:
            request = json.loads(message)
        except ValueError:
            request = None
        if request is None or len(fds) != 2:
            for received in fds:
                os.close(received)
            conn.send(b"{}")
            continue
        pid = os.fork()
        if pid == 0:
            conn.close()
            _be_the_kernel(request, fds)
        for received in fds:
            os.close(received)
        conn.send(json.dumps({"pid": pid}).encode())


def _be_the_kernel(request: dict, fds: list[int]) -> None:
    """In a child the zygote forked: become the kernel ``python -m ipykernel_launcher ARGV`` would start, with the
    request's environment, working directory and output, and leave as its interpreter would."""
    import importlib.util
    import random
    import tempfile
    import traceback

    from course_lib.launch.process_tree import take_std_streams

    code = 1
    try:
        os.setsid()  # as Popen(start_new_session=True): nbval's killpg reaches the kernel and its ranks
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        take_std_streams(os.open(os.devnull, os.O_RDONLY), *fds)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["JPY_PARENT_PID"] = str(os.getppid())
        tempfile.tempdir = None  # the kernel's TMPDIR, not the zygote's
        random.seed()  # a fresh interpreter's own seed
        sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, *request["argv"]]
        if sys.path and sys.path[0] == "":  # ``-c``'s entry, which ipykernel's launcher removes
            del sys.path[0]
        atexit._clear()  # the kernel's exit handlers run at its end, not the zygote's
        from ipykernel import kernelapp

        # the app read JPY_PARENT_PID when the zygote imported it: told here, its poller ends the kernel when the
        # zygote is gone (as a Popen'd kernel's ends it with pytest's worker)
        kernelapp.IPKernelApp.launch_instance([*request["argv"], f"--IPKernelApp.parent_handle={os.getppid()}"])
        code = 0
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)
    except BaseException:  # noqa: BLE001 - said on the kernel's stderr; nbval then says the kernel died
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
