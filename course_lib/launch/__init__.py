"""Run a function on N real ranks, from a notebook cell or a test.

``launch(fn, world_size=4)`` starts ``world_size`` processes, initialises
``torch.distributed`` in each (gloo on CPU, NCCL with one GPU per rank), runs
``fn(**kwargs)`` on every rank and returns the per-rank return values in rank
order. Two launchers, one contract:

* ``launcher="fork"`` forks the current process: ranks start in a fraction of a
  second and can run functions defined in a notebook. CPU labs and tests use it.
* ``launcher="torchrun"`` runs ``python -m torch.distributed.run --standalone
  --nproc-per-node N`` -- the command you type on a GPU box. ``fn`` must be
  importable from a module there (not defined in a notebook cell).

Failure is never silent and never hangs: every process group gets ``timeout``
seconds; the first rank to fail is the one named -- with its traceback, or with
its exit code or signal when it died without one (``os._exit``, a segfault, a
kill); a rank that hangs is reported when ``timeout`` expires. Each rank's
stdout/stderr is captured to its own buffer and printed grouped by rank, never
interleaved.

No process outlives its launch. However ``launch`` ends (results, a failure, a
timeout, Ctrl-C or a Jupyter interrupt, an exception) it kills the whole process
tree of its ranks -- torchrun starts its ranks in sessions of their own, so a
process group is not enough -- and checks that nothing is left before it returns
or raises. If the launching process is itself killed (a killed kernel), its
ranks die with it: each one asks Linux for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread polls ``os.getppid()``).

Nor does any temporary file, even when the launching process is killed: forked
ranks write their output into files that are already deleted (only open
descriptors hold them), and torchrun's job folder -- the ranks' reports, and
torch elastic's own ``torchelastic_*`` files, which it never removes -- is made
and removed by the process that supervises torchrun (:class:`TorchrunAgent`).
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import functools
import math
import numbers
import os
import pickle
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import connection
from pathlib import Path
from typing import Any, Callable, Sequence

LAUNCHERS = ("fork", "torchrun")
BACKENDS = ("auto", "gloo", "nccl")
OUTPUT_MODES = ("all", "rank0", "none")
MAX_TIMEOUT_S = 7 * 24 * 3600
# After the first rank fails, the others get this long to report their own
# failure (often a broken collective) before they are killed.
_GRACE_AFTER_FAILURE_S = 0.3
# How often the launcher looks for ranks that died, and a rank for a dead parent
# where there is no parent-death signal.
_POLL_S = 0.1
_PARENT_POLL_S = 0.5
# torchrun: how long start-up (imports, rendezvous) may take on top of
# ``timeout``, and how long after ``timeout`` the ranks' own watchdogs get to
# report before the launcher stops everything itself.
_TORCHRUN_STARTUP_S = 60
_WATCHDOG_GRACE_S = 3
_TORCHRUN_SIGTERM_S = 10
# How long torchrun's agent may take to remove its job folder and end once released.
_AGENT_EXIT_S = 10
# How much earlier than it is noticed a rank's death is dated (see _death_report).
_DEATH_NOTICE_S = 0.5
# Set in every rank process (to its rank), so that launch() can refuse to nest.
RANK_ENV = "COURSE_LIB_LAUNCH_RANK"
# RankError.exc_type of a rank that died without reporting (no traceback), and
# of a result that the launching process cannot unpickle.
PROCESS_DIED = "ProcessDied"
RESULT_UNREADABLE = "ResultUnreadable"
_SIGNAL_HINTS = {signal.SIGSEGV: "a crash in native code", signal.SIGABRT: "an abort in native code",
                 signal.SIGKILL: "killed from outside, often by the out-of-memory killer"}


class LaunchError(RuntimeError):
    """Base class: something went wrong on the ranks."""


class RankError(LaunchError):
    """A rank failed. ``rank`` is the first rank that failed, ``traceback`` its text
    (for a rank that died without one, how it died), ``exc_type`` the exception
    class name (``"ProcessDied"`` for such a death, ``"ResultUnreadable"`` for a
    result this process cannot unpickle), ``outputs`` every rank's
    captured output, ``other_failures`` the later failures by rank."""

    def __init__(self, rank: int, exc_type: str, tb: str, outputs: list[str],
                 other_failures: dict[int, str] | None = None):
        self.rank, self.exc_type, self.traceback = rank, exc_type, tb
        self.outputs = outputs
        self.other_failures = other_failures or {}
        last_line = tb.strip().splitlines()[-1] if tb.strip() else exc_type
        if exc_type in (PROCESS_DIED, RESULT_UNREADABLE):  # the launcher's account: it names the rank
            msg = tb.strip()
            if rank < len(outputs) and outputs[rank].strip():  # a crash's Python stack, if any, is in it
                msg += f"\n\n--- last output of rank {rank} ---\n{_tail(outputs[rank], 40)}"
        else:
            msg = f"rank {rank} failed: {last_line}\n\n--- traceback of rank {rank} ---\n{tb}"
        if self.other_failures:
            msg += "\nother ranks that failed: " + ", ".join(
                f"{r} ({t.strip().splitlines()[-1]})" for r, t in sorted(self.other_failures.items()))
        super().__init__(msg)


class LaunchTimeout(LaunchError):
    """Some ranks did not finish within the timeout (a hang or a deadlock).
    ``stopped`` says what became of the rank processes (checked, not assumed)."""

    def __init__(self, timeout: float, unfinished: list[int], outputs: list[str],
                 stopped: str = "every rank process was stopped"):
        self.timeout, self.unfinished, self.outputs, self.stopped = timeout, unfinished, outputs, stopped
        tails = "".join(
            f"\n--- last output of rank {r} ---\n{_tail(outputs[r])}" for r in unfinished if outputs[r].strip())
        super().__init__(
            f"ranks {unfinished} did not finish within timeout={timeout:g}s (a hang or deadlock: "
            f"check that every rank calls the same collectives in the same order); {stopped}{tails}")


class RankResults(list):
    """The per-rank return values (a plain list, rank order) plus ``outputs``
    (each rank's captured stdout+stderr), ``elapsed_s`` and ``command``
    (the torchrun command line, for ``launcher="torchrun"``)."""

    outputs: list[str]
    elapsed_s: float
    command: str | None = None


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` -> ``"nccl"`` when there is one CUDA GPU per rank, else ``"gloo"``."""
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown: use one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{gpus} CUDA GPUs are visible; use backend='gloo' or fewer ranks")
    return backend


def _check_args(world_size, launcher, output, timeout):
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is unknown: use 'fork' (fast, notebooks) or 'torchrun'")
    if output not in OUTPUT_MODES:
        raise ValueError(f"output={output!r} is unknown: use one of {', '.join(OUTPUT_MODES)}")
    if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout)
            or not 0 < timeout <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, at most "
                         f"{MAX_TIMEOUT_S} (a week); e.g. timeout=60")


def _refuse_nested_launch() -> None:
    rank = os.environ.get(RANK_ENV)
    if rank is not None:
        raise LaunchError(f"launch() was called on rank {rank} of another launch: nested launches are not "
                          f"supported; call launch() once, from the notebook or script, and give each rank its "
                          f"part of the work")


def init_rank(rank: int, world_size: int, backend: str, timeout: float, store=None) -> None:
    """Initialise ``torch.distributed`` in this process (one rank) with ``timeout``
    on the default group. Without ``store`` the rendezvous comes from torchrun's
    environment (``env://``).

    With NCCL the rank gets its own GPU and the group is ``"cpu:gloo,cuda:nccl"``:
    CUDA tensors travel over NCCL while the labs' CPU tensors still work (gloo).
    """
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "cpu:gloo,cuda:nccl"
    kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout))
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(**kwargs)


def print_outputs(outputs: Sequence[str], output: str = "all", file=None) -> None:
    """Print captured rank outputs, each under a ``[rank r]`` header."""
    file = file or sys.stdout
    if output == "none":
        return
    ranks = range(len(outputs)) if output == "all" else [0]
    for r in ranks:
        text = outputs[r]
        if not text:
            continue
        if output == "all" and len(outputs) > 1:
            print(f"[rank {r}]", file=file)
        print(text.rstrip("\n"), file=file)


def launch(fn: Callable[..., Any], /, world_size: int = 4, launcher: str = "fork", backend: str = "auto",
           timeout: float = 60, output: str = "all", **kwargs) -> RankResults:
    """Run ``fn(**kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``output``: print the ranks' captured output grouped by rank (``"all"``),
    only rank 0's (``"rank0"``) or nothing (``"none"``; it is still in ``.outputs``).
    Raises ``ValueError`` for bad arguments, ``RankError`` when a rank fails,
    ``LaunchTimeout`` when ranks do not finish within ``timeout`` seconds, and
    ``KeyboardInterrupt("interrupted: ...")`` on Ctrl-C once every rank is stopped.
    """
    _refuse_nested_launch()
    _check_args(world_size, launcher, output, timeout)
    world_size = int(world_size)
    backend = resolve_backend(backend, world_size)
    if launcher == "fork" and backend == "nccl":
        import torch

        if torch.cuda.is_initialized():
            raise ValueError("CUDA is already initialised in this process, and forked ranks cannot use it: "
                             "use launcher='torchrun', or restart the kernel and launch before touching the GPU")
    start = time.perf_counter()
    if launcher == "fork":
        results = _launch_fork(fn, world_size, backend, timeout, kwargs)
    else:
        results = _launch_torchrun(fn, world_size, backend, timeout, kwargs)
    results.elapsed_s = time.perf_counter() - start
    print_outputs(results.outputs, output)
    return results


def _first_failure(failures: dict[int, tuple[str, str, float]], outputs: list[str]) -> RankError:
    """The error to raise for ``{rank: (exception name, traceback, time)}``: the
    earliest failure is the cause; later ones are usually its consequence
    (peers of a dead rank see their collectives break)."""
    first = min(failures, key=lambda r: (failures[r][2], r))
    exc_type, tb, _ = failures[first]
    return RankError(first, exc_type, tb, outputs, {r: f[1] for r, f in failures.items() if r != first})


def describe_exit(exitcode: int | None) -> str:
    """How a process that reported nothing ended, from its exit code (negative: the signal)."""
    if exitcode is None:
        return "ended without reporting a result"
    if exitcode >= 0:
        return f"exited with code {exitcode} without reporting a result"
    try:
        sig = signal.Signals(-exitcode)
    except ValueError:
        return f"was killed by signal {-exitcode}"
    hint = _SIGNAL_HINTS.get(sig)
    return f"was killed by signal {sig.name}" + (f" ({hint})" if hint else "")


def _death_report(rank: int, exitcode: int | None, noticed_at: float) -> tuple[str, str, float]:
    """The failure record of a rank that died without reporting, like a rank's own (name, text, time).

    Its peers' failures follow such a death by milliseconds ("Connection closed by
    peer"), while the death itself is noticed by a process or thread that must
    first be scheduled -- later still on a busy machine. Dated back by
    ``_DEATH_NOTICE_S``, the death sorts before the failures it caused.
    """
    return PROCESS_DIED, f"rank {rank} {describe_exit(exitcode)}\n", noticed_at - _DEATH_NOTICE_S


def _load_results(payloads: dict[int, bytes], outputs: list[str]) -> RankResults:
    """Unpickle every rank's return value here, in the launching process; a value that
    cannot be read here (e.g. an instance of a class this process cannot import) names its rank."""
    values = []
    for rank in range(len(outputs)):
        try:
            values.append(pickle.loads(payloads[rank]))
        except Exception as exc:  # noqa: BLE001 - any unpickling error: name the rank
            raise RankError(rank, RESULT_UNREADABLE, (
                f"rank {rank} returned a value that cannot be unpickled in the launching process: "
                f"{type(exc).__name__}: {exc}; return plain data (numbers, lists, dicts, tensors)\n"),
                outputs) from None
    results = RankResults(values)
    results.outputs = outputs
    return results


# ------------------------------------------------------------------ process lifetime


@functools.lru_cache(maxsize=None)
def _libc_prctl():
    """libc's ``prctl``, or None off Linux. Looked up before any fork: a forked child should not dlopen."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _watch_parent(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os.kill(os.getpid(), sig)


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Make this process receive ``sig`` when its parent ``parent_pid`` ends.

    Linux sends it itself (``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``);
    elsewhere a daemon thread polls ``os.getppid()``. A parent that died before
    this call (the child was then adopted by another process) is noticed at once.
    """
    prctl = _libc_prctl()
    pr_set_pdeathsig = 1
    if prctl is None or prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) != 0:
        threading.Thread(target=_watch_parent, args=(parent_pid, sig), daemon=True,
                         name="die-with-parent").start()
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def _parent_pids() -> dict[int, int] | None:
    """``{pid: parent pid}`` of every process, read from /proc; None where there is no /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    parents = {}
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # it just ended
                continue
            # "pid (command) state ppid ...": the command may contain spaces and parentheses
            parents[int(name)] = int(stat.rpartition(b")")[2].split()[1])
    return parents


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int, keep_root: bool = False) -> list[int]:
    """SIGKILL ``pid`` and every descendant, whatever session they are in; return the pids killed.

    Each generation is stopped (SIGSTOP) before its children are listed, so that
    no process can start a child we miss, nor reap one (its pid stays its own).
    ``pid`` must be an unreaped child of this process. ``keep_root``: kill only
    the descendants, and let ``pid`` go on (SIGCONT). Without /proc, ``pid``'s
    process group stands in for its descendants (``keep_root`` kills nothing).
    """
    if _parent_pids() is None:
        if keep_root:
            return []
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return [pid]
    tree, generation = [], [pid]
    while generation:
        for p in generation:
            _send(p, signal.SIGSTOP)
        tree += generation
        parents = _parent_pids() or {}
        generation = [child for child, parent in parents.items() if parent in generation and child not in tree]
    victims = tree[1:] if keep_root else tree
    for p in reversed(victims):
        _send(p, signal.SIGKILL)
    if keep_root:
        _send(pid, signal.SIGCONT)
    return victims


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
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
    except PermissionError:
        return True
    return True


def wait_gone(pids: Sequence[int], timeout: float = 10) -> list[int]:
    """Wait until none of ``pids`` runs (at most ``timeout`` s); return those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if is_running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _stopped(done: str, survivors: Sequence[int]) -> str:
    """``done`` ("all 4 rank processes were stopped") when no process survived, else which did."""
    if not survivors:
        return done
    pids = " ".join(map(str, survivors))
    return f"{len(survivors)} processes could not be stopped (pids {pids}): end them with kill -9 {pids}"


def _supervise(wait: Callable[[], Any], stop: Callable[[], str]) -> tuple[Any, str]:
    """``wait()`` for the ranks, then ``stop()`` every process however the wait ends.

    Returns wait's result and stop's report. An exception is re-raised once
    everything is stopped; Ctrl-C (a Jupyter interrupt) as
    ``KeyboardInterrupt("interrupted: <what was stopped>")``.
    """
    try:
        result = wait()
    except KeyboardInterrupt as exc:
        raise type(exc)(f"{getattr(exc, 'reason', 'interrupted')}: {stop()}") from None
    except BaseException:
        stop()
        raise
    return result, stop()


# --------------------------------------------------------------------------- fork


def _redirect_output(fd: int) -> None:
    """Point this process's stdout/stderr (Python objects and C file descriptors) at the open file ``fd``."""
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # A forked Jupyter kernel's sys.stdout talks to threads that do not exist in
    # the child; replace it with a plain line-buffered file on fd 1.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.stdout
    # A crash in native code (segfault, abort) leaves the rank's Python stack in
    # its own output, not in the launching process's.
    faulthandler.enable(file=sys.stderr)


def _fork_child(rank, world_size, backend, timeout, host, port, fn, kwargs, conn, out_fd, parent_pid):
    die_with_parent(parent_pid)  # first: a killed kernel takes its ranks with it
    status, payload = "error", b""
    try:
        _redirect_output(out_fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch

        torch.set_num_threads(1)  # several ranks on 2 cores: OpenMP oversubscription hangs
        import torch.distributed as dist

        # What torchrun would set, so code reads the same under both launchers.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        os.environ[RANK_ENV] = str(rank)

        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        init_rank(rank, world_size, backend, timeout, store=store)
        value = fn(**kwargs)
        try:
            payload = pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            raise TypeError(f"the return value of fn on rank {rank} cannot be pickled: {exc}") from None
        status = "ok"
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, end="")
        payload = pickle.dumps((type(exc).__name__, tb, time.time()))
    try:
        sys.stdout.flush()
        conn.send_bytes(pickle.dumps((status, payload)))
        # Stay alive until the launcher ends every rank: a rank that exits
        # early closes its sockets while slower peers may still be talking to
        # it (even inside init_process_group's connection set-up).
        conn.recv_bytes()
    except (EOFError, OSError):
        pass
    finally:
        os._exit(0)  # never run the parent's atexit handlers in a forked child


def _record_death(pid: int, sentinel: int, rank: int, deaths: dict[int, tuple[float, int | None]]) -> None:
    """Wait (in a thread) for rank process ``pid`` to die; record when, and its exit code.

    A rank that dies hard never reports, and its pipe may close later than it
    died (a child of its own can hold it open): this time, not the time the
    launcher notices, is what orders it against the failures of its peers.
    WNOWAIT leaves the process to be reaped by multiprocessing. (Without
    os.waitid -- macOS before Python 3.13 -- the process sentinel stands in.)
    """
    exitcode = None
    if hasattr(os, "waitid"):
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            exitcode = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        except ChildProcessError:  # already reaped
            pass
    else:
        connection.wait([sentinel])
    deaths[rank] = (time.time(), exitcode)


def _receive(conn) -> tuple[str, bytes] | None:
    """A rank's report from its pipe, or None when it died without sending one."""
    try:
        if conn.poll():
            return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        pass
    return None


def _stop_forked(procs) -> str:
    """Kill every forked rank and whatever it started; report, checked, what was stopped."""
    pids = []
    for p in procs:
        if p.exitcode is None:  # still unreaped, so its pid is still its own
            pids += kill_tree(p.pid)
    for p in procs:
        p.join()
    return _stopped(f"all {len(procs)} rank processes were stopped", wait_gone(pids))


def _fork_ranks(ctx, procs, conns, world_size, backend, timeout, listener, fn, kwargs, out_files):
    """Fork the ranks (appending each to ``procs``, its pipe to ``conns``), then serve their rendezvous.

    The rendezvous socket is bound before any child exists, but the store's
    server thread starts only after the last fork: forking while another thread
    holds a lock can deadlock the child. Returns the store (keep it until the end).
    """
    import torch.distributed as dist

    host, port = listener.getsockname()
    for rank in range(world_size):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_fork_child, daemon=True, args=(
            rank, world_size, backend, timeout, host, port, fn, kwargs, theirs, out_files[rank].fileno(),
            os.getpid()))
        p.start()
        theirs.close()
        procs.append(p)
        conns[mine] = rank
    return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout),
                         master_listen_fd=listener.detach())  # the store owns the socket now


def _collect_reports(procs, conns, timeout):
    """Read each rank's report (or note its death) until all have reported, ``timeout``
    passes, or ``_GRACE_AFTER_FAILURE_S`` after the first failure. Returns
    ``({rank: pickled result}, {rank: (exception name, traceback, time)})``."""
    payloads, failures, deaths = {}, {}, {}
    watchers = [threading.Thread(target=_record_death, args=(p.pid, p.sentinel, r, deaths), daemon=True)
                for r, p in enumerate(procs)]
    for w in watchers:
        w.start()
    pending = dict(conns)
    first_failure_at = None
    deadline = time.monotonic() + timeout
    while pending:
        now = time.monotonic()
        limit = deadline if first_failure_at is None else min(deadline, first_failure_at + _GRACE_AFTER_FAILURE_S)
        if now >= limit:
            break
        ready = connection.wait(list(pending), timeout=min(limit - now, _POLL_S))
        dead = [c for c, r in pending.items() if r in deaths]
        for c in dict.fromkeys([*ready, *dead]):
            rank = pending.pop(c)
            report = _receive(c)
            if report is None:  # died without reporting (os._exit, a signal, a crash)
                watchers[rank].join(timeout=2)
                noticed_at, exitcode = deaths.get(rank, (time.time(), None))
                report = ("error", pickle.dumps(_death_report(rank, exitcode, noticed_at)))
            status, payload = report
            if status == "ok":
                payloads[rank] = payload
            else:
                failures[rank] = pickle.loads(payload)
                if first_failure_at is None:
                    first_failure_at = time.monotonic()
    return payloads, failures


def _read_back(file) -> str:
    """All that was written to ``file`` (a temporary file that child processes wrote to
    through descriptors sharing its offset), read without moving that offset."""
    fd = file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def _launch_fork(fn, world_size, backend, timeout, kwargs) -> RankResults:
    import multiprocessing as mp

    # backward(grad) imports sympy lazily (~2.5 s); import it once here so that
    # every forked rank inherits it instead of paying for it again.
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    _libc_prctl()  # looked up here, before the forks
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # the OS picks the port: no race
    listener.listen(world_size)
    # Each rank's output goes to a file deleted at birth: nothing is left on disk however this process ends.
    out_files = [tempfile.TemporaryFile(prefix="course_launch_") for _ in range(world_size)]
    procs, conns, store = [], {}, None
    sys.stdout.flush()
    sys.stderr.flush()

    def run_ranks():
        nonlocal store
        store = _fork_ranks(mp.get_context("fork"), procs, conns, world_size, backend, timeout, listener, fn,
                            kwargs, out_files)
        return _collect_reports(procs, conns, timeout)

    try:
        # Reported ranks are parked (see _fork_child), the others failed to
        # report in time: either way, every rank process ends here.
        (payloads, failures), stopped = _supervise(run_ranks, lambda: _stop_forked(procs))
    finally:
        for c in conns:
            c.close()
        outputs = [_read_back(f) for f in out_files]
        for f in out_files:
            f.close()
        del store
        listener.close()  # a no-op once detached
    if failures:
        raise _first_failure(failures, outputs)
    if len(payloads) < world_size:
        raise LaunchTimeout(timeout, sorted(set(range(world_size)) - set(payloads)), outputs, stopped)
    return _load_results(payloads, outputs)


# ------------------------------------------------------------------------ torchrun


def torchrun_command(world_size: int, target: Sequence[str]) -> list[str]:
    """The torchrun command line for ``world_size`` ranks on one machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world_size}", *target]


class TorchrunAgent:
    """A :func:`torchrun_command` line run so that neither torchrun, nor its ranks, nor its
    files outlive this process, however it ends. A context manager::

        with TorchrunAgent(cmd, env=env) as agent:
            (agent.job / "job.pkl").write_bytes(...)    # the folder the ranks read and write
            agent.start()
            code = agent.wait()                         # or poll(seconds); stop() on any trouble

    torchrun runs under an agent, ``python -m course_lib.launch.worker --agent-of PID``,
    in a session of its own (a terminal's Ctrl-C reaches only this process, which then
    stops the whole tree with :meth:`stop`). The agent makes the job folder ``job``
    (torchrun's temporary files, torch elastic's ``torchelastic_*``, go to ``job/tmp``),
    starts torchrun on :meth:`start`, and SIGTERMs it when this process dies, however it
    dies (torchrun then stops its ranks). Once torchrun has ended and this process has
    let go of the folder (:meth:`release`, on leaving the ``with`` block) or died, the
    agent removes the folder and ends. The agent's stdin is a socket to this process:
    the folder's path comes over it, then "go" goes the other way, then torchrun's exit
    code; closing it lets go.
    """

    def __init__(self, cmd: Sequence[str], **popen_kwargs):
        if list(cmd[1:3]) != ["-m", "torch.distributed.run"]:
            raise ValueError(f"not a torchrun_command() line: {shlex.join(cmd)}")
        # The agent's temporary folder is this process's (tempfile.tempdir included).
        env = dict(popen_kwargs.pop("env", None) or os.environ, TMPDIR=tempfile.gettempdir())
        self._channel, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [cmd[0], "-m", "course_lib.launch.worker", "--agent-of", str(os.getpid()), *cmd[3:]],
                stdin=theirs, start_new_session=True, env=env, **popen_kwargs)
        except BaseException:
            self._channel.close()
            raise
        finally:
            theirs.close()
        self.job: Path | None = None
        self.exit_code: int | None = None  # torchrun's, once it has ended
        self._ended = False
        try:
            path = _receive_line(self._channel)
        except BaseException:
            self.release()
            raise
        if not path:
            self.release()
            raise LaunchError(f"torchrun's agent ended before it started torchrun (exit code {self.proc.returncode})")
        self.job = Path(os.fsdecode(path))

    def __enter__(self) -> "TorchrunAgent":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def start(self) -> None:
        """Start torchrun (the job folder is ready)."""
        self._channel.sendall(b"g")

    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for torchrun to end; whether it has (then see ``exit_code``)."""
        if not self._ended and connection.wait([self._channel], timeout):
            code = _receive_line(self._channel)  # nothing: the agent itself died
            self.exit_code = int(code) if code else None
            self._ended = True
        return self._ended

    def wait(self) -> int | None:
        """Wait for torchrun to end; its exit code (None when its agent was killed)."""
        while not self.poll(_POLL_S * 10):
            pass
        return self.exit_code

    def stop(self, rank_pids: Sequence[int] = ()) -> str:
        """Kill torchrun and every process under it -- all but the agent, which still has
        to remove the job folder -- and report, checked, what was stopped.

        ``rank_pids``: rank processes known otherwise, checked too (when torchrun ended
        by itself, its ranks are no longer under it). Without /proc to find the ranks
        (macOS), the agent gets SIGTERM, on which torchrun stops them itself.
        """
        if self.proc.returncode is not None:  # reaped: its pid may be another's now
            pids = []
        elif _parent_pids() is not None:
            pids = kill_tree(self.proc.pid, keep_root=True)
        else:
            self.proc.terminate()
            pids = [] if self.poll(_TORCHRUN_SIGTERM_S + _AGENT_EXIT_S) else kill_tree(self.proc.pid)
        survivors = wait_gone([*pids, *rank_pids])
        if _parent_pids() is None and not rank_pids:
            return _stopped("torchrun was stopped, and it stops its ranks (no /proc here to check them)", survivors)
        return _stopped("torchrun and all its rank processes were stopped", survivors)

    def release(self) -> None:
        """Let go of the job folder: the agent removes it and ends (once torchrun has ended).
        An agent that does not end within ``_AGENT_EXIT_S`` is killed, and the folder removed here."""
        self._channel.close()
        try:
            self.proc.wait(timeout=_AGENT_EXIT_S)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
        if self.job is not None:  # a killed agent could not remove it
            shutil.rmtree(self.job, ignore_errors=True)


def _receive_line(sock: socket.socket) -> bytes:
    """One line from ``sock``, without its newline; what came before the end if the other side closed it."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            return line
        line += chunk
    return line[:-1]


class _Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the process tree is stopped first."""

    reason = "terminated"


def _raise_terminated(signum, frame):
    raise _Terminated()


def run_torchrun(cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run a :func:`torchrun_command` line in the foreground (``python -m course_lib train``);
    return its exit code.

    Ctrl-C or SIGTERM stop torchrun and every rank (checked), print what was
    stopped and return 130 / 143; if this process is killed outright, torchrun
    stops its ranks itself, and no file is left either (:class:`TorchrunAgent`).
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        with TorchrunAgent(cmd, env=env) as agent:
            agent.start()
            code, _ = _supervise(agent.wait, agent.stop)
    except KeyboardInterrupt as exc:
        print(f"{exc}", file=sys.stderr, flush=True)
        return 128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if code is None:  # the agent was killed: its own exit code says how
        code = agent.proc.returncode
    return code if code >= 0 else 128 - code


def _importable_name(fn) -> tuple[str, str]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    name = getattr(fn, "__name__", repr(fn))
    if module in (None, "__main__") or "<" in qualname:
        where = "a notebook cell or script (__main__)" if module == "__main__" else "a local scope"
        raise ValueError(
            f"fn {name!r} is defined in {where}; torchrun starts fresh Python processes that must "
            f"import it: move it into a module file, or use launcher='fork'")
    return module, qualname


def _import_root(module: str) -> str | None:
    """The sys.path entry from which ``module`` was imported (``/x`` for ``/x/a/b.py`` = ``a.b``)."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if not path:
        return None
    root = Path(path).resolve().parent
    for _ in range(module.count(".")):
        root = root.parent
    return str(root)


def _wait_for_torchrun(agent: TorchrunAgent, world_size: int, timeout: float) -> bool:
    """Wait for torchrun to end; False if it runs past the backstop.

    Each rank stops itself ``timeout`` s after it starts ``fn`` (its watchdog,
    in torchrun_worker) and torchrun then stops the others. The backstop covers a
    rank whose watchdog cannot run (e.g. native code holding the GIL): ``timeout``
    plus a grace after every rank has started, or ``_TORCHRUN_STARTUP_S`` more
    when they never all start (a hang in start-up).
    """
    deadline = time.monotonic() + _TORCHRUN_STARTUP_S + timeout
    all_started = False
    while not agent.poll(_POLL_S):
        if not all_started and all((agent.job / f"rank{r}.started").exists() for r in range(world_size)):
            all_started = True
            deadline = min(deadline, time.monotonic() + timeout + _WATCHDOG_GRACE_S)
        if time.monotonic() >= deadline:
            return False
    return True


def _rank_pids(job: Path, world_size: int) -> list[int]:
    """The pids each rank's supervisor recorded (itself and the rank; see torchrun_worker)."""
    pids = []
    for r in range(world_size):
        try:
            pids += [int(p) for p in (job / f"rank{r}.pids").read_text().split()]
        except (OSError, ValueError):
            pass
    return pids


def _read_reports(job: Path, world_size: int):
    """What the ranks left in ``job``: (outputs, {rank: failure}, {rank: pickled result}, hung ranks)."""
    def rank_file(r, ext):
        return job / f"rank{r}.{ext}"

    outputs = [rank_file(r, "out").read_text(errors="replace") if rank_file(r, "out").exists() else ""
               for r in range(world_size)]
    # Written by each rank, or by its supervising parent when it died without a word.
    failures = {r: pickle.loads(rank_file(r, "err").read_bytes())
                for r in range(world_size) if rank_file(r, "err").exists()}
    payloads = {r: rank_file(r, "pkl").read_bytes() for r in range(world_size) if rank_file(r, "pkl").exists()}
    hung = [r for r in range(world_size) if rank_file(r, "timeout").exists()]
    return outputs, failures, payloads, hung


def _launch_torchrun(fn, world_size, backend, timeout, kwargs) -> RankResults:
    module, qualname = _importable_name(fn)
    job_spec = pickle.dumps(dict(module=module, qualname=qualname, kwargs=kwargs, backend=backend, timeout=timeout))
    cmd = torchrun_command(world_size, ["-m", "course_lib.launch.worker"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Make fn's module (and whatever the caller could import) importable there.
    paths = [_import_root(module), *(p or os.getcwd() for p in sys.path)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    with tempfile.TemporaryFile(prefix="course_torchrun_") as log, \
            TorchrunAgent(cmd, stdout=log, stderr=subprocess.STDOUT, env=env) as agent:
        (agent.job / "job.pkl").write_bytes(job_spec)
        agent.start()
        finished, stopped = _supervise(lambda: _wait_for_torchrun(agent, world_size, timeout),
                                       lambda: agent.stop(_rank_pids(agent.job, world_size)))
        outputs, failures, payloads, hung = _read_reports(agent.job, world_size)
        launcher_log = _read_back(log)
    if hung:  # checked first: the others' errors are the consequence
        raise LaunchTimeout(timeout, hung, outputs, stopped)
    if failures:
        raise _first_failure(failures, outputs)
    if not finished:
        raise LaunchTimeout(timeout, sorted(set(range(world_size)) - set(payloads)), outputs, stopped)
    if len(payloads) < world_size:
        raise LaunchError(f"torchrun exited with code {agent.exit_code} before all ranks reported:\n"
                          f"{_tail(launcher_log, 30)}")
    results = _load_results(payloads, outputs)
    results.command = shlex.join(["torchrun", *cmd[3:]])
    return results
