"""``launch(..., launcher="torchrun")`` and ``python -m course_lib train``: torchrun, run so that
nothing outlives it.

:func:`torchrun_command` is the command line, :class:`TorchrunAgent` runs it under an agent
process that owns the job folder (:mod:`course_lib.launch.worker` is the agent, torchrun and
each rank), :func:`run_torchrun` runs it in the foreground, and :func:`launch_torchrun` runs
``fn`` on its ranks and reads their reports back from the job folder.
"""

from __future__ import annotations

import io
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
import types
from multiprocessing import connection
from pathlib import Path
from typing import Sequence

from course_lib.launch.contract import (LOOPBACK_ADDR, MAX_TIMEOUT_S, LaunchError, LaunchTimeout, RankResults,
                                        load_results)
from course_lib.launch.output import read_back, tail
from course_lib.launch.process_tree import (POLL_S, first_failure, kill_tree, parent_pids, stop_report, supervise,
                                            wait_gone)
from course_lib.rules import UsageError

# How far a launch got when its deadline passed (LaunchTimeout.phase).
RENDEZVOUS, START_UP, RUN = "rendezvous", "start-up", "run"

# torchrun: how long start-up (imports, rendezvous) may take on top of
# ``timeout``, and how long after ``timeout`` the ranks' own watchdogs get to
# report before the launcher stops everything itself.
_TORCHRUN_STARTUP_S = 60
_WATCHDOG_GRACE_S = 3
# How long torchrun gets, once sent SIGTERM, to stop its ranks before its whole tree is killed.
TORCHRUN_SIGTERM_S = 10
# How long torchrun's agent may take to remove its job folder and end once released.
_AGENT_EXIT_S = 10


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
            raise UsageError(f"not a torchrun_command() line: {shlex.join(cmd)}")
        # The agent's temporary folder is this process's (tempfile.tempdir included).
        env = dict(popen_kwargs.pop("env", None) or os.environ, TMPDIR=tempfile.gettempdir())
        if "--standalone" in cmd:
            # --local-addr (torchrun reads PET_<FLAG>): the address it gives its ranks as MASTER_ADDR. Without
            # it, the machine's FQDN: where the hostname does not resolve, the ranks never find their store.
            env.setdefault("PET_LOCAL_ADDR", LOOPBACK_ADDR)
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
        while not self.poll(POLL_S * 10):
            pass
        return self.exit_code

    def unjoined(self, world_size: int) -> list[int]:
        """The ranks that have not (yet) joined the process group (no ``rank{r}.joined``, see ``init_rank``)."""
        return [r for r in range(world_size) if not (self.job / f"rank{r}.joined").exists()]

    def phase(self, world_size: int) -> tuple[str, list[int]]:
        """How far the job got: (:data:`RUN`, []) once every rank has joined the process group, else
        (:data:`START_UP` or :data:`RENDEZVOUS`, the ranks not joined) -- :data:`RENDEZVOUS` while
        torchrun has started no rank process (its own rendezvous; without /proc, said as start-up)."""
        missing = self.unjoined(world_size)
        if not missing:
            return RUN, []
        parents = parent_pids()
        if parents is not None:
            torchrun = {pid for pid, parent in parents.items() if parent == self.proc.pid}
            if not any(parent in torchrun for parent in parents.values()):
                return RENDEZVOUS, missing
        return START_UP, missing

    def running_ranks(self, world_size: int) -> list[int]:
        """The ranks whose processes torchrun still runs (its children's ``RANK``, from /proc); every rank
        where none can be read (no /proc)."""
        parents = parent_pids() or {}
        torchrun = {pid for pid, parent in parents.items() if parent == self.proc.pid}
        ranks = set()
        for pid in (pid for pid, parent in parents.items() if parent in torchrun):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.partition(b"=")[::2] for v in f.read().split(b"\0"))
                ranks.add(int(env[b"RANK"]))
            except (OSError, KeyError, ValueError):     # ended meanwhile (a zombie has no environment)
                continue
        return sorted(ranks) or list(range(world_size))

    def first_error(self, world_size: int) -> str | None:
        """``"rank R: <its error line>"`` of the rank that reported an error first (``report_error``), or None."""
        records = []
        for r in range(world_size):
            try:
                at, _, line = (self.job / f"rank{r}.error").read_text(errors="replace").partition("\n")
                records.append((float(at), r, line))
            except (OSError, ValueError):
                continue
        return f"rank {min(records)[1]}: {min(records)[2]}" if records else None

    def stop(self, rank_pids: Sequence[int] = ()) -> str:
        """Kill torchrun and every process under it -- all but the agent, which still has
        to remove the job folder -- and report, checked, what was stopped.

        ``rank_pids``: rank processes known otherwise, checked too (when torchrun ended
        by itself, its ranks are no longer under it). Without /proc to find the ranks
        (macOS), the agent gets SIGTERM, on which torchrun stops them itself.
        """
        if self.proc.returncode is not None:  # reaped: its pid may be another's now
            pids = []
        elif parent_pids() is not None:
            pids = kill_tree(self.proc.pid, keep_root=True)
        else:
            self.proc.terminate()
            pids = [] if self.poll(TORCHRUN_SIGTERM_S + _AGENT_EXIT_S) else kill_tree(self.proc.pid)
        survivors = wait_gone([*pids, *rank_pids])
        if parent_pids() is None and not rank_pids:
            return stop_report("torchrun was stopped, and it stops its ranks (no /proc here to check them)", survivors)
        return stop_report("torchrun and all its rank processes were stopped", survivors)

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


def _wait_joined(agent: TorchrunAgent, world_size: int, startup_timeout: float,
                 run_timeout: float | None = None) -> int | None:
    """Wait for torchrun's job until every rank has joined the process group, then until it ends; its
    exit code. If the ranks have not all joined ``startup_timeout`` s after the start, or have not ended
    ``run_timeout`` s after that (None: no limit), stop everything and raise :class:`LaunchTimeout`
    naming the phase that hung (torchrun's rendezvous, start-up, or the run)."""
    start = time.monotonic()
    while agent.unjoined(world_size):
        if agent.poll(POLL_S):
            return agent.exit_code
        if time.monotonic() - start >= startup_timeout:
            phase, missing = agent.phase(world_size)
            raise LaunchTimeout(startup_timeout, missing, [""] * world_size, agent.stop(), phase=phase,
                                waited=time.monotonic() - start)
    if run_timeout is None:
        return agent.wait()
    deadline = time.monotonic() + run_timeout
    while not agent.poll(min(POLL_S * 10, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            running = agent.running_ranks(world_size)
            raise LaunchTimeout(run_timeout, running, [""] * world_size, agent.stop(), phase=RUN)
    return agent.exit_code


def _keep(log) -> str:
    """Copy the unlinked ``log`` to a new named file in the temporary folder; its path."""
    fd, path = tempfile.mkstemp(prefix="course_torchrun_", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(read_back(log))
    log.close()
    return path


def run_torchrun(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float | None = None,
                 run_timeout: float | None = None) -> int:
    """Run a :func:`torchrun_command` line in the foreground (``python -m course_lib train``);
    return its exit code.

    The ranks' stdout reaches the terminal as they print it; stderr -- torchrun's own (its
    ChildFailedError traceback), the ranks' warnings and tracebacks -- goes to a log. A run that
    fails prints one line: the first failing rank's error (:func:`course_lib.launch.contract.report_error`),
    with its rank, and where the log is kept; a run that succeeds prints the log's text, if any, and removes it.

    ``timeout``: the process groups' (``--distributed-timeout-minutes``); torchrun's rendezvous and the
    ranks' start-up must end within it plus ``_TORCHRUN_STARTUP_S``, else everything is stopped and
    one line names the phase that hung (exit code 124); after that, the groups' timeout bounds every
    collective, and ``run_timeout`` (seconds from the moment every rank has joined; None: no limit) the
    whole run, a rank stuck outside a collective included: past it, the same (the phase: the run). Ctrl-C or SIGTERM stop torchrun and every rank (checked), print what was
    stopped and return 130 / 143; if this process is killed outright, torchrun
    stops its ranks itself, and no file is left either (:class:`TorchrunAgent`).
    """
    world_size = int(next(a for a in cmd if a.startswith("--nproc-per-node=")).partition("=")[2])
    startup_timeout = _TORCHRUN_STARTUP_S + (timeout if timeout is not None else MAX_TIMEOUT_S)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    # Deleted at birth (nothing is left if this process is killed); kept, as a named file, only for a failure.
    log = tempfile.TemporaryFile(prefix="course_torchrun_")
    code, first = None, None
    try:
        with TorchrunAgent(cmd, env=env, stderr=log) as agent:
            agent.start()
            code, _ = supervise(lambda: _wait_joined(agent, world_size, startup_timeout, run_timeout), agent.stop)
            first = agent.first_error(world_size)
    except LaunchTimeout as exc:
        print(f"error: {str(exc).splitlines()[0]} (the log: {_keep(log)})", file=sys.stderr, flush=True)
        return 124
    except KeyboardInterrupt as exc:
        log.close()
        print(f"{exc}", file=sys.stderr, flush=True)
        return 128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if code is None:  # the agent was killed: its own exit code says how
        code = agent.proc.returncode
    code = code if code >= 0 else 128 - code
    if code == 0:
        print(read_back(log), end="", file=sys.stderr, flush=True)
        log.close()
    else:
        said = first or f"torchrun exited with code {code}, and no rank reported an error"
        print(f"error: {said} (the whole report, tracebacks included: {_keep(log)})", file=sys.stderr, flush=True)
    return code


def _not_importable(obj) -> str | None:
    """Why a fresh Python process cannot import the function or class ``obj`` by name; None if it can."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if qualname.rpartition(".")[2] == "<lambda>":
        return "is a lambda"
    if module == "__main__":
        return "is defined in a notebook cell or script (__main__)"
    if module is None or "<" in qualname:
        return "is defined in a local scope"
    return None


def _importable_name(fn) -> tuple[str, str]:
    where = _not_importable(fn)
    if where:
        raise UsageError(
            f"fn {getattr(fn, '__name__', repr(fn))!r} {where}; torchrun starts fresh Python processes that must "
            f"import it: move it into a module file, or use launcher='fork'")
    return fn.__module__, getattr(fn, "__qualname__", "")


class _NotImportable(Exception):
    """``obj``, a function or class inside an argument, cannot be imported by the ranks (``where`` says why)."""

    def __init__(self, obj, where: str):
        super().__init__(where)
        self.obj, self.where = obj, where


class _ArgumentPickler(pickle.Pickler):
    """A pickler that refuses, by name, a function or class the ranks could not import
    (pickle stores those by name: a lambda fails with an obscure error, a notebook's
    function only when the rank unpickles it)."""

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and (where := _not_importable(obj)):
            raise _NotImportable(obj, where)
        return NotImplemented


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    _ArgumentPickler(buffer).dump(value)
    return buffer.getvalue()


def _job_spec(**spec) -> bytes:
    """The job the ranks read (``spec["kwargs"]`` are ``fn``'s arguments), pickled; an argument
    that cannot travel to them is a one-line ``ValueError`` naming it, before anything starts."""
    try:
        return _dumps(spec)
    except Exception:  # noqa: BLE001 - whatever pickling raises: find the argument to name
        for name, value in spec["kwargs"].items():
            try:
                _dumps(value)
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, _NotImportable) and exc.obj is value:
                    what = f"={value.__qualname__} {exc.where}"
                elif isinstance(exc, _NotImportable):
                    what = f" (a {type(value).__name__}) holds {exc.obj.__qualname__}, which {exc.where}"
                else:
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    what = f" (a {type(value).__name__}) cannot be pickled ({reason})"
                raise UsageError(
                    f"argument {name}{what}; torchrun starts fresh Python processes "
                    f"that receive each argument pickled: pass a function defined at the top of a module file, or "
                    f"another picklable value, or use launcher='fork'") from None
        raise


def _import_root(module: str) -> str | None:
    """The sys.path entry from which ``module`` was imported (``/x`` for ``/x/a/b.py`` = ``a.b``)."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if not path:
        return None
    root = Path(path).resolve().parent
    for _ in range(module.count(".")):
        root = root.parent
    return str(root)


def _wait_for_torchrun(agent: TorchrunAgent, world_size: int, timeout: float) -> tuple[str, list[int], float] | None:
    """Wait for torchrun to end; None if it did, else where the job was when it passed the backstop:
    (phase, the ranks not past it, seconds waited) -- see :meth:`TorchrunAgent.phase`.

    Each rank stops itself ``timeout`` s after it starts ``fn`` (its watchdog,
    in :mod:`course_lib.launch.worker`) and torchrun then stops the others. The backstop covers a
    rank whose watchdog cannot run (e.g. native code holding the GIL): ``timeout``
    plus a grace after every rank has started, or ``_TORCHRUN_STARTUP_S`` more
    when they never all start (a hang in torchrun's rendezvous or the ranks' start-up).
    """
    start = time.monotonic()
    deadline = start + _TORCHRUN_STARTUP_S + timeout
    all_started = False
    while not agent.poll(POLL_S):
        if not all_started and all((agent.job / f"rank{r}.started").exists() for r in range(world_size)):
            all_started = True
            deadline = min(deadline, time.monotonic() + timeout + _WATCHDOG_GRACE_S)
        if time.monotonic() >= deadline:
            phase, missing = agent.phase(world_size)
            return phase, missing, time.monotonic() - start
    return None


def _rank_pids(job: Path, world_size: int) -> list[int]:
    """The pids each rank's supervisor recorded (itself and the rank; see :mod:`course_lib.launch.worker`)."""
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


def launch_torchrun(fn, world_size, backend, timeout, kwargs) -> RankResults:
    module, qualname = _importable_name(fn)
    job_spec = _job_spec(module=module, qualname=qualname, kwargs=kwargs, backend=backend, timeout=timeout)
    cmd = torchrun_command(world_size, ["-m", "course_lib.launch.worker"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Make fn's module (and whatever the caller could import) importable there.
    paths = [_import_root(module), *(p or os.getcwd() for p in sys.path)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    with tempfile.TemporaryFile(prefix="course_torchrun_") as log, \
            TorchrunAgent(cmd, stdout=log, stderr=subprocess.STDOUT, env=env) as agent:
        (agent.job / "job.pkl").write_bytes(job_spec)
        agent.start()
        passed, stopped = supervise(lambda: _wait_for_torchrun(agent, world_size, timeout),
                                     lambda: agent.stop(_rank_pids(agent.job, world_size)))
        outputs, failures, payloads, hung = _read_reports(agent.job, world_size)
        launcher_log = read_back(log)
    if hung:  # checked first: the others' errors are the consequence
        raise LaunchTimeout(timeout, hung, outputs, stopped)
    if failures:
        raise first_failure(failures, outputs)
    if passed is not None:
        phase, missing, waited = passed
        if phase == RUN:
            missing, waited = sorted(set(range(world_size)) - set(payloads)), None
        raise LaunchTimeout(timeout, missing, outputs, stopped, phase=phase, waited=waited)
    if len(payloads) < world_size:
        raise LaunchError(f"torchrun exited with code {agent.exit_code} before all ranks reported:\n"
                          f"{tail(launcher_log, 30)}")
    results = load_results(payloads, outputs)
    results.command = shlex.join(["torchrun", *cmd[3:]])
    return results
