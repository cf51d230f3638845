"""The ranks' process tree: ranks that die with their parent, a tree that keeps every process
started under it (:func:`adopt_orphans`) and is killed whole and checked gone, a wait that stops
everything however it ends, and the blame -- how a rank died when it could not say so itself, and
which rank failed first."""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

from course_lib.launch.contract import PROCESS_DIED, RankError

# How often the launcher looks for ranks that died, and a rank for a dead parent
# where there is no parent-death signal.
POLL_S = 0.1
_PARENT_POLL_S = 0.5
# How much earlier than it is noticed a rank's death is dated (see death_report).
_DEATH_NOTICE_S = 0.5
_SIGNAL_HINTS = {signal.SIGSEGV: "a crash in native code", signal.SIGABRT: "an abort in native code",
                 signal.SIGKILL: "killed from outside, often by the out-of-memory killer"}


@functools.lru_cache(maxsize=None)
def libc_prctl():
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
    prctl = libc_prctl()
    pr_set_pdeathsig = 1
    if prctl is None or prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) != 0:
        threading.Thread(target=_watch_parent, args=(parent_pid, sig), daemon=True,
                         name="die-with-parent").start()
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


class PidfdProcess:
    """A ``Popen`` for a process this one did not start (a server forked it on request: the test session's judges
    and kernels): it is not this process's child, so its end is seen through a pidfd (Linux), its exit status is
    not (0)."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._pidfd = os.pidfd_open(pid)

    def poll(self):
        return self.wait(0)

    def wait(self, timeout: float | None = None):
        if self.returncode is None and select.select([self._pidfd], [], [], timeout)[0]:
            self.returncode = 0
            os.close(self._pidfd)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def take_std_streams(stdin: int, stdout: int, stderr: int, write_through: bool = False) -> None:
    """In a process just forked from a Python server, to serve as a process started with these pipes would: move
    the descriptors onto 0, 1 and 2 (closing the originals) and reopen ``sys.stdin``, ``sys.stdout`` and
    ``sys.stderr`` on them, line-buffered text (``write_through``: unbuffered, as ``PYTHONUNBUFFERED=1`` makes
    them). The judge server's judges, the grading sandbox's judge and the test session's kernels are forked so."""
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        if fd != target:
            os.dup2(fd, target)
            if fd not in (stdin, stdout, stderr)[target + 1:]:
                os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)
    if write_through:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)


def freeze_inherited_objects() -> None:
    """In a process just forked from a Python process, or in a server before it forks its children: move every
    object it holds to the garbage collector's permanent generation (``gc.freeze``), so that its collections walk
    only what it allocates from now on.

    A collection writes to every object it walks (its ``gc_refs``), so a forked child that walks what it inherited
    copies the pages of the parent's heap (copy-on-write), besides the walk itself. Measured here (2026-12-06), a
    child that allocates 20,000 dicts and collects once: 160 ms of CPU under a parent holding torch (224 MB), 334
    ms under 484 MB; 7 and 13 ms with the inherited objects frozen. ``gc.freeze`` only moves the lists' heads; the
    objects are still freed when their count drops to zero, and only cycles among them stay (a child is
    short-lived; a server keeps its imports anyway). Python's documentation recommends it around ``fork``.
    """
    gc.freeze()


def adopt_orphans() -> bool:
    """Keep in this process's tree every process started under it, even once its parent has ended.

    An orphan -- a process whose parent ended (a rank that returned, a daemon's shell)
    -- is re-parented to its nearest ancestor that is a "child subreaper" instead of
    to init (Linux's ``prctl(PR_SET_CHILD_SUBREAPER)``; not inherited by children),
    so :func:`kill_tree` on this process still finds it. Whether it worked (False off Linux).
    """
    prctl = libc_prctl()
    pr_set_child_subreaper = 36
    return prctl is not None and prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0


def parent_pids() -> dict[int, int] | None:
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
    ``pid`` must be an unreaped child of this process, or this process itself with
    ``keep_root``. ``keep_root``: kill only the descendants, and let ``pid`` go on
    (SIGCONT). Without /proc, ``pid``'s process group stands in for its descendants
    (``keep_root`` kills nothing).
    """
    if parent_pids() is None:
        if keep_root:
            return []
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return [pid]
    me = os.getpid()
    tree, generation = [], [pid]
    while generation:
        for p in generation:
            if p != me:
                _send(p, signal.SIGSTOP)
        tree += generation
        parents = parent_pids() or {}
        generation = [child for child, parent in parents.items() if parent in generation and child not in tree]
    victims = tree[1:] if keep_root else tree
    for p in reversed(victims):
        _send(p, signal.SIGKILL)
    if keep_root and pid != me:
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


def stop_report(done: str, survivors: Sequence[int]) -> str:
    """``done`` ("all 4 rank processes were stopped") when no process survived, else which did."""
    if not survivors:
        return done
    pids = " ".join(map(str, survivors))
    return f"{len(survivors)} processes could not be stopped (pids {pids}): end them with kill -9 {pids}"


def supervise(wait: Callable[[], Any], stop: Callable[[], str]) -> tuple[Any, str]:
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


def first_failure(failures: dict[int, tuple[str, str, float]], outputs: list[str]) -> RankError:
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


def death_report(rank: int, exitcode: int | None, noticed_at: float) -> tuple[str, str, float]:
    """The failure record of a rank that died without reporting, like a rank's own (name, text, time).

    Its peers' failures follow such a death by milliseconds ("Connection closed by
    peer"), while the death itself is noticed by a process or thread that must
    first be scheduled -- later still on a busy machine. Dated back by
    ``_DEATH_NOTICE_S``, the death sorts before the failures it caused.
    """
    return PROCESS_DIED, f"rank {rank} {describe_exit(exitcode)}\n", noticed_at - _DEATH_NOTICE_S
