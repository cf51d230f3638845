"""``launch(..., launcher="fork")``: ranks forked from the launching process.

Ranks start in a fraction of a second and can run functions defined in a notebook. Each
rank reports over a pipe (that it joined the process group, then its pickled result, or its
failure with a traceback); a separate thread per rank records when it died, so a rank that died
without a word is dated before the failures it caused in its peers. Its output goes to a file
deleted at birth.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
from multiprocessing import connection

from course_lib.launch.contract import (RANK_ENV, LaunchTimeout, RankResults, failure_record, init_rank,
                                        load_results)
from course_lib.launch.output import read_back, redirect_output
from course_lib.launch.process_tree import (POLL_S, adopt_orphans, death_report, die_with_parent, first_failure,
                                            freeze_inherited_objects, kill_tree, libc_prctl, stop_report,
                                            supervise, wait_gone)

# After the first rank fails, the others get this long to report their own
# failure (often a broken collective) before they are killed.
_GRACE_AFTER_FAILURE_S = 0.3
# How long the ranks may take to start, on top of ``timeout``: a rank's own rendezvous timeout is ``timeout`` +
# this, counted from its start (a busy machine starts ranks slowly; the group gets ``timeout`` once joined), and
# its error says which rank could not join, and why. The launcher's own start-up deadline is later by
# _JOIN_REPORT_S, so that a rank's error, not the launcher's "start-up ran out", is what is reported.
_FORK_STARTUP_S = 10
_JOIN_REPORT_S = 3


def _startup_deadline_s(timeout: float) -> float:
    """Seconds the launcher waits for every rank to join the group before it names those that did not."""
    return timeout + _FORK_STARTUP_S + _JOIN_REPORT_S


# The message a rank sends once it has joined the process group, before its report.
_JOINED = ("joined", b"")


def _fork_child(rank, world_size, backend, timeout, host, port, fn, kwargs, conn, out_fd, parent_pid):
    die_with_parent(parent_pid)  # first: a killed kernel takes its ranks with it
    adopt_orphans()  # what fn starts stays under this rank, for _stop_forked to kill
    freeze_inherited_objects()
    status, payload = "error", b""
    try:
        redirect_output(out_fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch

        torch.set_num_threads(1)  # several ranks on 2 cores: OpenMP oversubscription hangs
        # What torchrun would set, so code reads the same under both launchers.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        os.environ[RANK_ENV] = str(rank)

        init_rank(rank, world_size, backend, timeout, master=(host, port), join_timeout=timeout + _FORK_STARTUP_S)
        conn.send_bytes(pickle.dumps(_JOINED))
        value = fn(**kwargs)
        try:
            payload = pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            raise TypeError(f"the return value of fn on rank {rank} cannot be pickled: {exc}") from None
        status = "ok"
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        payload = pickle.dumps(failure_record(exc))
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
    return stop_report(f"all {len(procs)} rank processes were stopped", wait_gone(pids))


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
    """Read each rank's report (or note its death) until all have reported, ``timeout`` passes
    once every rank has joined the group (``timeout`` + ``_FORK_STARTUP_S`` + ``_JOIN_REPORT_S`` until then), or
    ``_GRACE_AFTER_FAILURE_S`` after the first failure. Returns
    ``({rank: pickled result}, {rank: (exception name, traceback, time)}, {ranks that joined the group})``."""
    payloads, failures, deaths, joined = {}, {}, {}, set()
    watchers = [threading.Thread(target=_record_death, args=(p.pid, p.sentinel, r, deaths), daemon=True)
                for r, p in enumerate(procs)]
    for w in watchers:
        w.start()
    pending = dict(conns)
    first_failure_at = None
    deadline = time.monotonic() + _startup_deadline_s(timeout)
    while pending:
        now = time.monotonic()
        limit = deadline if first_failure_at is None else min(deadline, first_failure_at + _GRACE_AFTER_FAILURE_S)
        if now >= limit:
            break
        ready = connection.wait(list(pending), timeout=min(limit - now, POLL_S))
        dead = [c for c, r in pending.items() if r in deaths]
        for c in dict.fromkeys([*ready, *dead]):
            rank = pending[c]
            report = _receive(c)
            if report == _JOINED:
                joined.add(rank)
                if len(joined) == len(procs):
                    deadline = min(deadline, time.monotonic() + timeout)
                continue
            del pending[c]
            if report is None:  # died without reporting (os._exit, a signal, a crash)
                watchers[rank].join(timeout=2)
                noticed_at, exitcode = deaths.get(rank, (time.time(), None))
                report = ("error", pickle.dumps(death_report(rank, exitcode, noticed_at)))
            status, payload = report
            if status == "ok":
                payloads[rank] = payload
            else:
                failures[rank] = pickle.loads(payload)
                if first_failure_at is None:
                    first_failure_at = time.monotonic()
    return payloads, failures, joined


IMPORTED_BEFORE_THE_FORKS = ("torch.fx.experimental.symbolic_shapes",)
"""What a launch imports before it forks its ranks, so that every rank inherits it instead of paying for it again:
``backward(grad)`` imports sympy lazily (0.3 s of CPU here, seconds on a slow disk). A server that forks processes
which launch (the checkers' judge, ``grade``'s zygote) imports it once, before its own forks."""


def import_before_the_forks() -> None:
    """Import :data:`IMPORTED_BEFORE_THE_FORKS` (at once where they are imported already)."""
    import importlib

    for module in IMPORTED_BEFORE_THE_FORKS:
        importlib.import_module(module)


def launch_fork(fn, world_size, backend, timeout, kwargs) -> RankResults:
    import multiprocessing as mp

    import_before_the_forks()
    libc_prctl()  # looked up here, before the forks
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
        (payloads, failures, joined), stopped = supervise(run_ranks, lambda: _stop_forked(procs))
    finally:
        for c in conns:
            c.close()
        outputs = [read_back(f) for f in out_files]
        for f in out_files:
            f.close()
        del store
        listener.close()  # a no-op once detached
    if failures:
        raise first_failure(failures, outputs)
    if len(joined) < world_size:  # start-up (fork, import, rendezvous) ran past its deadline
        raise LaunchTimeout(timeout, sorted(set(range(world_size)) - joined), outputs, stopped, phase="start-up",
                            waited=_startup_deadline_s(timeout))
    if len(payloads) < world_size:
        raise LaunchTimeout(timeout, sorted(set(range(world_size)) - set(payloads)), outputs, stopped)
    return load_results(payloads, outputs)
